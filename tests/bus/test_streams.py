"""The bus against a real redis-server: groups, dead letters, reclaim, atomic commits, trimming, fan-out, state."""

import asyncio
import importlib.util
import subprocess
import sys
import time

import pytest
import redis
from hypothesis import strategies as st
from structlog.testing import capture_logs

from bus.arrays import packb
from bus.commit import CommitConflict, NotOwned
from bus.entries import Entry
from bus.errors import RlbusError
from bus.messages import DeadLetter, Metric, Task
from bus.policy import PolicyTracker
from tests.paths import REPO
from tests.policy import publish_trained

GROUP = "rollout"
args = st.lists(
    st.one_of(st.binary(max_size=7000), st.text(max_size=50), st.integers(), st.floats(allow_nan=False)),
    max_size=12,
)


def task(i: int) -> Task:
    return Task(task_id=f"e:0:{i}", env="e", example_index=i, example_id=str(i), group_size=2)


async def test_publish_read_ack(bus):
    async with bus("w1") as b:
        stream = b.keys.tasks("e")
        ids = await b.publish_many(stream, [task(i) for i in range(5)])
        assert ids == sorted(ids) and len(set(ids)) == 5
        entries = await b.read_group([stream], GROUP, count=3)
        assert [e.message.task_id for e in entries] == ["e:0:0", "e:0:1", "e:0:2"]
        assert all(isinstance(e, Entry) and e.deliveries == 1 and e.stream == stream for e in entries)
        await b.ack(stream, GROUP, [e.id for e in entries])
        rest = await b.read_group([stream], GROUP, count=10)
        assert [e.id for e in rest] == ids[3:]
        assert await b.read_group([stream], GROUP, count=10) == []
        pending = await b.redis.xpending(stream, GROUP)
        assert pending["pending"] == 2


async def test_read_group_blocks_until_an_entry_arrives(bus):
    async with bus("reader") as b, bus("writer") as w:
        stream = b.keys.tasks("e")
        await b.ensure_group(stream, GROUP)
        reader = asyncio.create_task(b.read_group([stream], GROUP, block_ms=5000))
        await asyncio.sleep(0.1)
        await w.publish(stream, task(0))
        entries = await asyncio.wait_for(reader, 5)
        assert [e.message.task_id for e in entries] == ["e:0:0"]


async def test_malformed_entry_is_dead_lettered_and_consumer_keeps_going(bus):
    async with bus("w1") as b:
        stream = b.keys.tasks("e")
        await b.publish(stream, task(0))
        bad_id = (await b.redis.xadd(stream, {"kind": "task", "v": "1", "data": b"\xc1garbage"})).decode()
        await b.publish(stream, task(2))
        with capture_logs() as logs:
            entries = await b.read_group([stream], GROUP, count=10)
        (logged,) = [e for e in logs if e["event"] == "entry_dead_lettered"]  # what an operator greps for
        assert logged["stream"] == stream and logged["entry_id"] == bad_id and "not valid msgpack" in logged["reason"]
        assert [e.message.task_id for e in entries] == ["e:0:0", "e:0:2"]
        dead = await b.read_fanout(b.keys.dead())
        assert len(dead) == 1
        letter = dead[0][1]
        assert isinstance(letter, DeadLetter)
        assert letter.entry_id == bad_id and letter.stream == stream and letter.worker == "w1"
        assert "not valid msgpack" in letter.reason
        assert letter.fields["data"] == b"\xc1garbage"
        pending_ids = {p["message_id"].decode() for p in await b.redis.xpending_range(stream, GROUP, "-", "+", 10)}
        assert bad_id not in pending_ids and len(pending_ids) == 2


@pytest.mark.parametrize(
    "fields, words",
    [
        ({b"\xff\xfe": b"\x00", b"kind": b"task"}, "no 'v' field"),
        ({b"kind": b"task", b"v": b"1", b"data": packb(["<i4", [1], b"\x00" * 4])}, "expected a map"),
        ({b"kind": b"rollout_group", b"v": b"1", b"data": packb({"samples": [{"prompt_ids": ["<x9", [1], b"abcd"]}]})},
         "does not validate"),
    ],
    ids=["non-utf8-field-name", "array-instead-of-map", "unknown-dtype"],
)
async def test_any_bytes_go_to_dead_and_the_consumer_keeps_going(bus, fields, words):
    async with bus("w1") as b:
        stream = b.keys.tasks("e")
        bad_id = (await b.redis.xadd(stream, fields)).decode()
        await b.publish(stream, task(1))
        entries = await b.read_group([stream], GROUP, count=10)
        assert [e.message.task_id for e in entries] == ["e:0:1"]
        (_, letter), = await b.read_fanout(b.keys.dead())
        assert letter.entry_id == bad_id and words in letter.reason
        assert len(letter.fields) == len(fields)
        pending = {p["message_id"].decode() for p in await b.redis.xpending_range(stream, GROUP, "-", "+", 10)}
        assert bad_id not in pending


async def test_an_oversized_entry_goes_to_dead_cut_short_and_fanout_readers_skip_it(bus):
    async with bus("w1", max_entry_bytes=4096) as b:
        stream = b.keys.tasks("e")
        big = Task(task_id="e:0:0", env="e", example_index=0, example_id="x" * 10_000, group_size=2)
        big_id = await b.publish(stream, big)
        await b.publish(stream, task(1))
        entries = await b.read_group([stream], GROUP, count=10)
        assert [e.message.task_id for e in entries] == ["e:0:1"]
        (_, letter), = await b.read_fanout(b.keys.dead())
        assert letter.entry_id == big_id and "exceeds redis.max_entry_bytes=4096" in letter.reason
        assert max(len(v) for v in letter.fields.values()) == 1024  # the dead letter keeps each field's first KiB
        assert big_id not in {p["message_id"].decode()
                              for p in await b.redis.xpending_range(stream, GROUP, "-", "+", 10)}
        await b.publish(b.keys.metrics(), Metric(source="x" * 5000, step=1, values={}))
        await b.publish(b.keys.metrics(), Metric(source="small", step=2, values={}))
        assert [m.source for _, m in await b.read_fanout(b.keys.metrics())] == ["small"]
        await b.publish(b.keys.metrics(), Metric(source="y" * 5000, step=3, values={}))
        assert (await b.last(b.keys.metrics()))[1].source == "small"


async def test_a_group_reader_acks_what_it_skips_unread(bus):
    async with bus("w1") as b:
        stream = b.keys.tasks("e")
        ids = await b.publish_many(stream, [task(i) for i in range(4)])
        entries = await b.read_group([stream], GROUP, count=10, skip=lambda f: int(f[b"example_id"]) % 2 == 1)
        assert [e.message.task_id for e in entries] == ["e:0:0", "e:0:2"]
        assert (await b.redis.xpending(stream, GROUP))["pending"] == 2  # the skipped two: acked
        replayed, after = await b.read_pending(stream, GROUP, skip=lambda f: f[b"example_id"] == b"2")
        assert [e.message.task_id for e in replayed] == ["e:0:0"] and after == ids[2]


async def test_fanout_readers_skip_what_they_cannot_decode(bus):
    async with bus("w1") as b:
        policy = b.keys.policy()
        await b.redis.xadd(policy, {b"kind": b"policy_version", b"v": b"1", b"data": b"\xc1"})
        await b.redis.xadd(policy, {b"\xff": b"\xff"})
        await publish_trained(b, 3)
        tracker = PolicyTracker(b)
        assert await tracker.refresh() and tracker.trained == 3
        await b.redis.xadd(b.keys.weights(), {b"kind": b"weight_update", b"v": b"1", b"data": b"\x80"})
        assert await b.last(b.keys.weights()) is None


async def test_dead_consumer_entries_are_reclaimed_once(bus):
    async with bus("dies", claim_idle_ms=200) as a, bus("survivor", claim_idle_ms=200) as b:
        stream = a.keys.tasks("e")
        await a.publish_many(stream, [task(i) for i in range(6)])
        taken = await a.read_group([stream], GROUP, count=4)  # then "dies" without acking
        assert len(taken) == 4
        assert await b.reclaim(stream, GROUP) == []  # not idle long enough yet
        fresh = await b.read_group([stream], GROUP, count=10)
        await b.ack(stream, GROUP, [e.id for e in fresh])
        processed = [e.message.task_id for e in fresh]
        await asyncio.sleep(0.3)
        reclaimed = await b.reclaim(stream, GROUP)
        assert all(e.deliveries == 2 for e in reclaimed)
        processed += [e.message.task_id for e in reclaimed]
        await b.ack(stream, GROUP, [e.id for e in reclaimed])
        await asyncio.sleep(0.3)
        assert await b.reclaim(stream, GROUP) == []
        assert sorted(processed) == sorted(f"e:0:{i}" for i in range(6))
        consumers = {c["name"].decode(): c["pending"] for c in await b.redis.xinfo_consumers(stream, GROUP)}
        assert consumers["dies"] == 0


async def test_entry_delivered_more_than_max_deliveries_goes_dead(bus):
    cfg = {"claim_idle_ms": 100, "max_deliveries": 2}
    async with bus("a", **cfg) as a, bus("b", **cfg) as b, bus("c", **cfg) as c:
        stream = a.keys.tasks("e")
        await a.publish(stream, task(0))
        assert len(await a.read_group([stream], GROUP)) == 1  # delivery 1
        await asyncio.sleep(0.15)
        assert len(await b.reclaim(stream, GROUP)) == 1  # delivery 2
        await asyncio.sleep(0.15)
        assert await c.reclaim(stream, GROUP) == []  # delivery 3 > 2: dead
        letter = (await c.last(c.keys.dead()))[1]
        assert letter.deliveries == 3 and "max_deliveries=2" in letter.reason
        assert (await c.redis.xpending(stream, GROUP))["pending"] == 0


async def test_dead_lettered_task_releases_its_inflight_samples(bus):
    from bus.state import INFLIGHT_FIELD, release_inflight

    cfg = {"claim_idle_ms": 100, "max_deliveries": 1}
    async with bus("a", **cfg) as a, bus("b", **cfg) as b:
        stream = a.keys.tasks("e")
        await a.redis.hset(a.keys.state(), INFLIGHT_FIELD, 2)
        await a.publish(stream, task(0))  # group_size 2
        assert len(await a.read_group([stream], GROUP)) == 1
        await asyncio.sleep(0.15)
        assert await b.reclaim(stream, GROUP, on_dead=release_inflight(b.keys.state())) == []
        assert int(await b.redis.hget(b.keys.state(), INFLIGHT_FIELD)) == 0
        assert (await b.redis.xpending(stream, GROUP))["pending"] == 0


async def test_commit_acks_and_publishes_together(bus):
    async with bus("w1") as b:
        tasks, out = b.keys.tasks("e"), b.keys.metrics()
        await b.publish_many(tasks, [task(0), task(1)])
        entries = await b.read_group([tasks], GROUP)
        ids = await b.commit(
            [(tasks, GROUP, e.id) for e in entries],
            [(out, Metric(source="t", values={"n": 1.0})), (out, Metric(source="t", values={"n": 2.0}))],
            extra=lambda pipe: pipe.hincrby(b.keys.state(), "inflight", -2),
        )
        assert len(ids) == 2 and await b.redis.xlen(out) == 2
        assert (await b.redis.xpending(tasks, GROUP))["pending"] == 0
        assert await b.state_get("inflight") == "-2"


async def test_commit_failure_between_acks_and_outputs_leaves_neither(bus):
    async with bus("w1") as b:
        tasks, out = b.keys.tasks("e"), b.keys.metrics()
        await b.publish(tasks, task(0))
        entries = await b.read_group([tasks], GROUP)
        acks = [(tasks, GROUP, e.id) for e in entries]
        outputs = [(out, Metric(source="t", values={"n": 1.0}))]

        class Unencodable(Metric):
            def entry_args(self):
                raise RuntimeError("injected: died while encoding the outputs")

        with pytest.raises(RuntimeError, match="injected"):
            await b.commit(acks, [*outputs, (out, Unencodable(source="t", values={}))])
        assert (await b.redis.xpending(tasks, GROUP))["pending"] == 1
        assert await b.redis.xlen(out) == 0

        def failing_extra(pipe):
            raise RuntimeError("injected in extra")

        with pytest.raises(RuntimeError, match="injected in extra"):
            await b.commit(acks, outputs, extra=failing_extra)
        assert (await b.redis.xpending(tasks, GROUP))["pending"] == 1
        assert await b.redis.xlen(out) == 0
        await b.commit(acks, outputs)  # the connection is still usable
        assert (await b.redis.xpending(tasks, GROUP))["pending"] == 0 and await b.redis.xlen(out) == 1


async def test_a_commit_whose_input_was_reclaimed_writes_nothing(bus):
    """A consumer stalled past claim_idle_ms lost its entry to another: its late commit must not publish."""

    async with bus("stalled", claim_idle_ms=100) as a, bus("other", claim_idle_ms=100) as b:
        stream, out = a.keys.tasks("e"), a.keys.rollouts("e")
        await a.publish(stream, task(0))
        (mine,) = await a.read_group([stream], GROUP)
        await asyncio.sleep(0.2)
        (theirs,) = await b.reclaim(stream, GROUP)
        await b.commit([(stream, GROUP, theirs.id)], [(out, Metric(source="other", values={}))])
        with pytest.raises(NotOwned, match="no longer pending for stalled"):
            await a.commit([(stream, GROUP, mine.id)], [(out, Metric(source="stalled", values={}))],
                           extra=lambda pipe: pipe.hincrby(a.keys.state(), "inflight", -2))
        assert [f[b"source"] for _, f in await a.redis.xrange(out)] == [b"other"]
        assert await a.state_get("inflight") is None


async def test_a_commit_retried_after_its_reply_was_lost_publishes_once(bus):
    async with bus("w1") as b:
        stream, out = b.keys.tasks("e"), b.keys.rollouts("e")
        await b.publish(stream, task(0))
        (entry,) = await b.read_group([stream], GROUP)
        commit = ([(stream, GROUP, entry.id)], [(out, Metric(source="w1", values={}))])
        await b.commit(*commit)
        with pytest.raises(NotOwned):  # the retry of a commit that went through
            await b.commit(*commit)
        assert await b.redis.xlen(out) == 1


async def test_keep_alive_renews_only_what_this_consumer_still_owns(bus):
    async with bus("slow", claim_idle_ms=150) as a, bus("taker", claim_idle_ms=150) as b:
        stream = a.keys.tasks("e")
        await a.publish_many(stream, [task(0), task(1)])
        held = [(stream, e.id) for e in await a.read_group([stream], GROUP, count=2)]
        await asyncio.sleep(0.2)
        (taken,) = await b.reclaim(stream, GROUP, count=1)  # the first one goes to the other consumer
        lost = []
        with capture_logs() as logs:
            keep = asyncio.create_task(a.keep_claimed(GROUP, lambda: held, on_lost=lost.append))
            await asyncio.sleep(0.2)
            keep.cancel()
        owners = {p["message_id"].decode(): p["consumer"].decode()
                  for p in await a.redis.xpending_range(stream, GROUP, "-", "+", 10)}
        assert owners == {taken.id: "taker", held[1][1]: "slow"}  # not taken back
        assert lost and lost[0] == (stream, taken.id)
        entry_lost = [(e["stream"], e["entry_id"]) for e in logs if e["event"] == "entry_lost"]
        assert entry_lost and set(entry_lost) == {(stream, taken.id)}  # what an operator greps for


async def test_keep_alive_stops_the_worker_when_redis_stays_away(bus, monkeypatch):
    async with bus("w1", claim_idle_ms=150) as b:
        async def refused(*args, **kwargs):
            raise redis.ConnectionError("Redis went away")

        monkeypatch.setattr(b, "_renew", refused)
        with pytest.raises(RlbusError, match="keep-alive failed for"):
            await asyncio.wait_for(b.keep_claimed(GROUP, lambda: [("s", "1-0")]), 5)


async def test_commit_guard(bus, redis_url):
    async with bus("w1") as b:
        state, out = b.keys.state(), b.keys.metrics()
        metric = Metric(source="packer", values={})
        step = lambda n: lambda pipe: pipe.hset(state, "packer:last_step", n)  # noqa: E731
        await b.commit([], [(out, metric)], guard=(state, "packer:last_step", None), extra=step(1))
        with pytest.raises(CommitConflict, match="expected None"):
            await b.commit([], [(out, metric)], guard=(state, "packer:last_step", None), extra=step(1))
        await b.commit([], [(out, metric)], guard=(state, "packer:last_step", "1"), extra=step(2))
        assert await b.state_get("packer:last_step") == "2" and await b.redis.xlen(out) == 2

        other = redis.Redis.from_url(redis_url)

        def racing_writer(pipe):  # another packer commits while this one prepares its commit
            other.hset(state, "packer:last_step", 3)
            step(3)(pipe)

        with pytest.raises(CommitConflict, match="is b?'3', expected '2'"):
            await b.commit([], [(out, metric)], guard=(state, "packer:last_step", "2"), extra=racing_writer)
        other.close()
        assert await b.redis.xlen(out) == 2


async def test_maxlen_trims_approximately(bus):
    async with bus("w1", maxlen=50) as b:
        stream = b.keys.metrics()
        for i in range(0, 1000, 100):
            await b.publish_many(stream, [Metric(source="t", values={"i": float(j)}) for j in range(i, i + 100)])
        length = await b.redis.xlen(stream)
        assert 50 <= length <= 50 + 100  # ~ trims whole macro nodes (100 entries each)
        _, newest = await b.last(stream)
        assert newest.values == {"i": 999.0}


async def test_read_fanout_and_state(bus):
    async with bus("w1") as b:
        stream = b.keys.weights()
        assert await b.last(stream) is None
        ids = await b.publish_many(stream, [Metric(source="t", values={"i": float(i)}) for i in range(5)])
        first = await b.read_fanout(stream, count=3)
        assert [i for i, _ in first] == ids[:3]
        rest = await b.read_fanout(stream, first[-1][0])
        assert [m.values["i"] for _, m in rest] == [3.0, 4.0]
        assert await b.read_fanout(stream, rest[-1][0]) == []
        await b.redis.xadd(stream, {"kind": "metric", "v": "1", "data": b"junk"})
        good = await b.publish(stream, Metric(source="t", values={}))
        assert [i for i, _ in await b.read_fanout(stream, ids[-1])] == [good]

        assert await b.state_get("x") is None
        await b.state_set(x=1, y="a")
        assert await b.state_get("x") == "1" and await b.state_incr("x", 4) == 5


async def test_bus_benchmark_runs(redis_url, capsys):
    spec = importlib.util.spec_from_file_location("bench_bus", REPO / "benchmarks" / "bus.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ratio = await bench.bench(redis_url, n=128, batch=32, rounds=1)
    assert ratio > 0
    assert "bus " in capsys.readouterr().out


@pytest.mark.timeout(150)
def test_bus_capacity_benchmark_runs():
    """One small level of producer and consumer processes, bus then bare: the saturation and ratio lines."""
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bus_capacity.py"), "--quick", "--seconds", "1",
                          "--levels", "1", "--tokens", "512", "--samples", "4", "--commit-mb", "1"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "saturation (512 tokens):" in out and "first saturated:" in out and "one commit" in out
    assert float(out.strip().splitlines()[-1].removeprefix("bus/bare ratio: ")) > 0


async def test_a_redis_restart_is_ridden_out(tmp_path):
    """The server goes away mid-run and comes back (same port, its AOF): every call in between waits and retries."""
    from bus.config import RedisConfig
    from bus.local_redis import LocalRedis
    from bus.streams import Bus

    server = LocalRedis(dir=tmp_path)
    url = server.start()
    port = server.port
    bus_ = await Bus.connect(url, "restart", RedisConfig(url=url), "w1")
    try:
        stream = bus_.keys.tasks("e")
        await bus_.publish(stream, task(0))
        (entry,) = await bus_.read_group([stream], GROUP)
        server.stop()
        restarted = LocalRedis(port=port, dir=tmp_path)
        back = asyncio.get_running_loop().run_in_executor(None, lambda: (time.sleep(1.0), restarted.start()))
        await bus_.publish(stream, task(1))  # waits for the server, then goes through
        await back
        await bus_.commit([(stream, GROUP, entry.id)], [(bus_.keys.rollouts("e"), Metric(source="w1", values={}))])
        assert await bus_.redis.xlen(stream) == 2 and await bus_.redis.xlen(bus_.keys.rollouts("e")) == 1
    finally:
        await bus_.close()
        restarted.stop()


async def test_a_password_from_the_environment_and_never_in_what_is_printed(tmp_path, monkeypatch):
    from bus.config import RedisConfig, redact
    from bus.local_redis import LocalRedis
    from bus.streams import Bus

    with LocalRedis(dir=tmp_path, password="pw-123") as server:
        monkeypatch.setenv("MY_REDIS_PASSWORD", "pw-123")
        cfg = RedisConfig(url=server.url, password_var="MY_REDIS_PASSWORD", reconnect_timeout_s=0)
        b = await Bus.connect(server.url, "secret", cfg, "w1")
        await b.publish(b.keys.tasks("e"), task(0))
        await b.close()
        monkeypatch.setenv("MY_REDIS_PASSWORD", "wrong")
        with pytest.raises(RlbusError) as failed:
            await Bus.connect(server.url, "secret", cfg, "w1")
        assert "wrong" not in str(failed.value)
    assert redact("redis://user:hunter2@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact("rediss://:hunter2@host/0") == "rediss://:***@host/0"
    assert redact("redis://host:6379/0") == "redis://host:6379/0"
