"""The feeder (env mixing, epochs, cursor, in-flight cap), pure logic and against a real redis."""

import asyncio
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from bus.messages import RolloutGroup, Task
from bus.state import INFLIGHT_FIELD, cursor_field, epoch_field
from workers.config import RlbusConfig
from workers.stages.feeder import EnvCursor, FeederWorker, epoch_order, pick_env


def _config(redis_url, run_name, envs, **feeder) -> RlbusConfig:
    return RlbusConfig.model_validate({
        "run": {"name": run_name, "seed": 7},
        "redis": {"url": redis_url, "block_ms": 50},
        "env": envs,
        "feeder": {"max_inflight_rollouts": 10_000, **feeder},
    })


def _tasks(redis_client, run_name, env) -> list[Task]:
    from bus.keys import Keys

    return [Task.from_fields(f) for _, f in redis_client.xrange(Keys(run_name).tasks(env))]


# Pure logic.


def test_epoch_order_is_a_seeded_permutation():
    a = epoch_order(50, seed=1, env="x", epoch=0)
    assert sorted(a) == list(range(50))
    assert a == epoch_order(50, seed=1, env="x", epoch=0)
    assert a != epoch_order(50, seed=1, env="x", epoch=1)
    assert epoch_order(5, seed=1, env="x", epoch=0, shuffle=False) == [0, 1, 2, 3, 4]


@given(st.lists(st.floats(0.1, 10), min_size=1, max_size=4), st.integers(1, 400))
def test_pick_env_holds_ratios_within_one_task(weights, n):
    cursors = [EnvCursor(f"e{i}", size=7, weight=w, group_size=1, mode="rl") for i, w in enumerate(weights)]
    for _ in range(n):
        c = pick_env(cursors)
        c.position, c.epoch = c.advance()
    total = sum(weights)
    for c in cursors:
        assert abs(c.issued - n * c.weight / total) <= 1 + 1e-9


def test_pick_env_stops_after_max_epochs():
    c = EnvCursor("a", size=2, weight=1, group_size=1, mode="rl")
    picks = 0
    while (chosen := pick_env([c], max_epochs=3)) is not None:
        chosen.position, chosen.epoch = chosen.advance()
        picks += 1
    assert picks == 6


# Against redis.


async def _run_until(feeder: FeederWorker, n: int):
    await feeder.setup()
    task = asyncio.create_task(feeder.run())
    while feeder.issued < n and not task.done():
        await asyncio.sleep(0.01)
    feeder.request_stop()
    await task
    await feeder.close()


async def test_ratios_hold_over_1000_tasks(redis_url, run_name, redis_client):
    envs = [{"id": "a", "ratio": 3, "group_size": 1}, {"id": "b", "ratio": 1, "group_size": 1}]
    feeder = FeederWorker(_config(redis_url, run_name, envs), sizes={"a": 37, "b": 1000})
    await _run_until(feeder, 1000)
    counts = Counter({e: len(_tasks(redis_client, run_name, e)) for e in ("a", "b")})
    total = counts["a"] + counts["b"]
    assert total >= 1000
    # Binomial sampling error at 1,000 draws with p = 0.75 is ~1.4%; stride scheduling is exact to one task.
    assert abs(counts["a"] / total - 0.75) < 0.014
    a = _tasks(redis_client, run_name, "a")
    for epoch in range(counts["a"] // 37):  # every full epoch visits every example once
        assert sorted(t.example_index for t in a if t.epoch == epoch) == list(range(37))


async def test_no_ratio_mixes_by_dataset_size(redis_url, run_name, redis_client):
    envs = [{"id": "a", "group_size": 1}, {"id": "b", "group_size": 1}]
    feeder = FeederWorker(_config(redis_url, run_name, envs), sizes={"a": 30, "b": 10})
    await _run_until(feeder, 200)
    a, b = len(_tasks(redis_client, run_name, "a")), len(_tasks(redis_client, run_name, "b"))
    assert abs(a / (a + b) - 0.75) < 0.02


async def test_restarted_feeder_continues_from_its_cursor(redis_url, run_name, redis_client):
    envs = [{"id": "a", "group_size": 2}]
    config = _config(redis_url, run_name, envs, max_epochs=2)
    capped = _config(redis_url, run_name, envs, max_epochs=2, max_inflight_rollouts=18)  # stops it after 9 tasks
    await _run_until(FeederWorker(capped, sizes={"a": 23}), 9)
    first = _tasks(redis_client, run_name, "a")
    assert len(first) == 9
    done = FeederWorker(config, sizes={"a": 23})
    await _setup_run_close(done)  # runs to max_epochs and returns by itself
    tasks = _tasks(redis_client, run_name, "a")
    assert len(tasks) == 46
    for epoch in (0, 1):
        got = [t.example_index for t in tasks if t.epoch == epoch]
        assert got == epoch_order(23, seed=7, env="a", epoch=epoch)  # nothing skipped, nothing repeated
    assert [t.task_id for t in tasks[:3]] == ["a:0:0", "a:0:1", "a:0:2"]
    state = redis_client.hgetall(f"rlbus:{{{run_name}}}:state")
    assert state[cursor_field("a").encode()] == b"0" and state[epoch_field("a").encode()] == b"2"
    assert int(state[INFLIGHT_FIELD.encode()]) == 46 * 2


async def _setup_run_close(worker):
    await worker.setup()
    try:
        await asyncio.wait_for(worker.run(), timeout=30)
    finally:
        await worker.close()


async def test_inflight_cap_blocks_until_the_packer_releases(redis_url, run_name, bus):
    """The cap spans feeder → packer: a forwarded group keeps its samples in flight; the packer's commit
    (metrics entry + release) and a rollout dead-letter wake the blocked feeder (block_ms is long: no polling)."""
    from bus.messages import DeadLetter, Metric

    envs = [{"id": "a", "group_size": 4}]
    config = _config(redis_url, run_name, envs)
    config.feeder.max_inflight_rollouts = 8
    config.redis.block_ms = 2000

    async def wait_issued(feeder, n):
        for _ in range(100):
            if feeder.issued == n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"issued {feeder.issued}, expected {n}")

    feeder = FeederWorker(config, sizes={"a": 100})
    await feeder.setup()
    task = asyncio.create_task(feeder.run())
    await asyncio.sleep(0.5)
    assert feeder.issued == 2  # 2 groups × 4 samples = the cap
    async with bus("filter") as b:
        state = b.keys.state()
        group = RolloutGroup(task_id="a:0:0", env="a", example_id="0", samples=[])
        await b.commit([], [(b.keys.filtered("a"), group), (b.keys.metrics(), Metric(source="filter", values={}))])
        await asyncio.sleep(0.3)
        assert feeder.issued == 2  # the filter forwarded it: still in flight (waiting for the packer)
        await b.commit([], [(b.keys.metrics(), Metric(source="packer", step=1, values={}))],  # the packer's step commit
                       extra=lambda p: p.hincrby(state, INFLIGHT_FIELD, -4))
        await wait_issued(feeder, 3)
        await asyncio.sleep(0.3)
        assert feeder.issued == 3
        assert await b.state_get(INFLIGHT_FIELD) == "8"
        letter = DeadLetter(stream=b.keys.tasks("a"), entry_id="1-0", reason="test", worker="rollout-x")
        await b.commit([], [(b.keys.dead(), letter)], extra=lambda p: p.hincrby(state, INFLIGHT_FIELD, -4))
        await wait_issued(feeder, 4)
    feeder.request_stop()
    await task
    await feeder.close()
