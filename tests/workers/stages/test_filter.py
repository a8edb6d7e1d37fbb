"""The filter worker against a real redis-server: atomic commits that release only dropped samples, collapse."""

import asyncio

import pytest

from bus.errors import CollapseError
from bus.keys import GROUP_FILTER
from bus.messages import Metric, RolloutGroup
from bus.state import STOP_REASON_FIELD, STREAK_FIELD
from tests.workers.stages.helpers import ENV, config, group, pending
from workers.stages.filter import FilterWorker


async def test_filter_commits_atomically_and_releases_only_dropped_samples(bus, redis_url, run_name,
                                                                           model_dir):
    cfg = config(redis_url, run_name, model_dir)
    cfg.filter.pre_batch_filters[2].enforce = True  # zero_advantage drops

    async with bus("test") as b:
        await b.state_set(inflight=10)
        await b.publish(b.keys.rollouts(ENV), group(1, [1.0, 0.0]))
        await b.publish(b.keys.rollouts(ENV), group(2, [1.0, 1.0]))  # zero advantage: dropped
        worker = FilterWorker(cfg, worker="filter-0")
        await worker.setup()
        entries = await worker.bus.read_group(worker.streams, GROUP_FILTER, count=16)
        await worker.process(entries)
        await worker.close()
        out = await b.redis.xrange(b.keys.filtered(ENV))
        assert len(out) == 1
        kept = RolloutGroup.from_fields(out[0][1])
        assert [s.advantage for s in kept.samples] == [0.5, -0.5]
        assert await b.state_get("inflight") == "8"  # the dropped group; the kept one waits for the packer
        assert await pending(b, b.keys.rollouts(ENV), GROUP_FILTER) == 0
        _, metric = await b.last(b.keys.metrics())
        assert metric.values["filter/zero_advantage/dropped"] == 2
        assert metric.values["filter/groups_dropped"] == 1 and metric.values["filter/groups"] == 1
        assert await b.state_get(STREAK_FIELD) == "1"


async def test_zero_variance_collapse_stops_with_the_message(bus, redis_url, run_name, model_dir):
    cfg = config(redis_url, run_name, model_dir, collapse_after=3)

    async with bus("test") as b:
        for uid, rewards in enumerate(
            [[1.0, 1.0], [0.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.5, 0.5], [0.0, 0.0]]
        ):
            await b.publish(b.keys.rollouts(ENV), group(uid, rewards))
        worker = FilterWorker(cfg, worker="filter-0")
        await worker.setup()
        with pytest.raises(CollapseError, match="zero reward variance") as info:
            await asyncio.wait_for(worker.run(), 20)
        await worker.close()
        assert "packer.collapse_after" in str(info.value) and "trainer.lr" in str(info.value)
        # the varied third group reset the streak: it stopped at the 3 that followed
        assert await b.state_get(STREAK_FIELD) == "3"
        assert "zero reward variance" in await b.state_get(STOP_REASON_FIELD)
        _, metric = await b.last(b.keys.metrics())
        assert isinstance(metric, Metric) and metric.values["collapse/zero_variance_groups"] == 3


async def test_a_group_that_breaks_the_filter_goes_dead_alone(bus, redis_url, run_name, model_dir,
                                                              monkeypatch):
    cfg = config(redis_url, run_name, model_dir)

    async with bus("test") as b:
        await b.state_set(inflight=6)
        for uid in (1, 2, 3):
            await b.publish(b.keys.rollouts(ENV), group(uid, [1.0, 0.0]))
        worker = FilterWorker(cfg, worker="filter-0")
        await worker.setup()
        real = worker.filter_group

        def breaks_on_the_second(group):
            if group.task_id.endswith(":2"):
                raise IndexError("a filter bug")
            return real(group)

        monkeypatch.setattr(worker, "filter_group", breaks_on_the_second)
        entries = await worker.bus.read_group(worker.streams, GROUP_FILTER, count=16)
        await worker.process(entries)
        await worker.close()
        forwarded = [RolloutGroup.from_fields(f).task_id for _, f in await b.redis.xrange(b.keys.filtered(ENV))]
        assert forwarded == [f"{ENV}:0:1", f"{ENV}:0:3"]
        (_, letter), = await b.read_fanout(b.keys.dead())
        assert letter.entry_id == entries[1].id and "IndexError: a filter bug" in letter.reason
        assert await b.state_get("inflight") == "4"  # the dead group's 2 samples given back
        assert await pending(b, b.keys.rollouts(ENV), GROUP_FILTER) == 0


def test_each_env_computes_advantages_with_its_own_settings(redis_url, run_name, model_dir):
    from workers.config import RlbusConfig

    cfg = RlbusConfig.model_validate({
        "run": {"name": run_name}, "redis": {"url": redis_url}, "model": {"path": str(model_dir)},
        "filter": {"advantage": {"length_penalty": 0.0}},
        "env": [{"id": "reverse_text", "name": ENV, "group_size": 2, "advantage": {"std_normalize": True}},
                {"id": "reverse_text", "name": "plain", "group_size": 2}]})
    worker = FilterWorker(cfg, worker="filter-0", vocab_size=300)
    normalised = group(1, [1.0, 0.0, 0.0, 0.0])
    plain = group(2, [1.0, 0.0, 0.0, 0.0]).replace(env="plain")
    worker.filter_group(normalised)
    worker.filter_group(plain)
    assert [round(s.advantage, 3) for s in plain.samples] == [0.75, -0.25, -0.25, -0.25]
    assert normalised.samples[0].advantage == pytest.approx(0.75 / 0.433, rel=1e-2)  # divided by the group's std
