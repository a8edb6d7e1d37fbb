"""Read-only views for monitoring (bus/observe.py): paged reads that advance their positions, group figures, ages
by Redis's clock, and a stream deleted under the reader."""

from bus.keys import Keys
from bus.observe import group_streams, heartbeat_ages, now_ms, read_after, stream_view


def test_read_after_drains_every_stream_in_pages_and_remembers_where_it_stopped(redis_client, run_name):
    keys = Keys(run_name)
    for i in range(5):
        redis_client.xadd(keys.tasks("a"), {"i": str(i)}, id=f"{i + 1}-0")
    redis_client.xadd(keys.tasks("b"), {"i": "b"}, id="9-0")
    positions = {keys.tasks("a"): "0", keys.tasks("b"): "0"}
    got = read_after(redis_client, positions, count=2)
    assert [(s, i) for s, i, _ in got if s == keys.tasks("a")] == [(keys.tasks("a"), f"{i}-0") for i in range(1, 6)]
    assert positions == {keys.tasks("a"): "5-0", keys.tasks("b"): "9-0"}
    assert read_after(redis_client, positions, block_ms=50) == []
    redis_client.xadd(keys.tasks("b"), {"i": "c"}, id="10-0")
    assert [i for _, i, _ in read_after(redis_client, positions)] == ["10-0"]


def test_group_figures_and_ages(redis_client, run_name):
    keys = Keys(run_name)
    stream = keys.rollouts("a")
    redis_client.xadd(stream, {"x": "1"}, id="1000-0")
    redis_client.xadd(stream, {"x": "2"}, id="2000-0")
    redis_client.xgroup_create(stream, "filter", id="0")
    redis_client.xreadgroup("filter", "filter-0", {stream: ">"}, count=1)
    assert group_streams(redis_client, keys) == [stream]
    at = now_ms(redis_client)
    view = stream_view(redis_client, keys, stream, at)
    assert (view.family, view.suffix, view.length) == ("rollouts", "a", 2)
    [group] = view.groups
    assert (group.name, group.lag, group.pending, group.consumers, group.max_deliveries) == ("filter", 1, 1, 1, 1)
    assert group.oldest_pending_age_s == (at - 1000) / 1000
    redis_client.delete(stream)
    assert stream_view(redis_client, keys, stream, at) is None
    redis_client.zadd(keys.workers(), {"trainer-0@h": at - 2500})
    assert heartbeat_ages(redis_client, keys.workers(), at) == {"trainer-0@h": 2.5}
