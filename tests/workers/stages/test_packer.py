"""The packer worker against a real redis-server: staleness, kill -9 between read and commit, held groups, partial
steps."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from bus.config import RedisConfig
from bus.keys import GROUP_PACKER
from bus.local_redis import LocalRedis
from bus.messages import Metric
from bus.state import LAST_STEP_FIELD
from bus.streams import Bus
from tests.outages import redis_outage
from tests.paths import REPO
from tests.policy import publish_trained
from tests.workers.stages.helpers import ENV, config, group, micro_batches, pending, read_all
from workers.stages.packer import PAUSE_ENV, PackerWorker


async def test_stale_groups_are_dropped_and_counted(bus, redis_url, run_name, model_dir):
    cfg = config(redis_url, run_name, model_dir, max_off_policy_steps=1)

    async with bus("test") as b:
        await b.state_set(**{LAST_STEP_FIELD: 4, "inflight": 8})  # next step s = 5
        await publish_trained(b, 4)
        stream = b.keys.filtered(ENV)
        await b.publish(stream, group(1, [1.0, 0.0], version=2))  # 2 behind policy s − 1 = 4: stale
        await b.publish(stream, group(2, [1.0, 0.0], version=3))  # 1 behind (= max_off): kept
        await b.publish(stream, group(3, [0.0, 1.0], version=4))
        await b.publish(stream, group(4, [0.0, 1.0], version=4))  # left over for step 6
        worker = PackerWorker(cfg, worker="packer-0")
        with capture_logs() as logs:
            await worker.setup()
            task = asyncio.create_task(worker.run())
            while not await b.redis.exists(b.keys.batches(5)):
                await asyncio.sleep(0.05)
            worker.request_stop()
            await asyncio.wait_for(task, 5)
            await worker.close()
        (dropped,) = [e for e in logs if e["event"] == "stale_groups_dropped"]  # what an operator greps for
        assert (dropped["step"], dropped["groups"], dropped["samples"]) == (5, 1, 2)
        batches = await micro_batches(b, 5)
        versions = sorted(v for mb in batches for v in mb.policy_versions.tolist())
        assert versions == [3, 3, 4, 4]
        assert await pending(b, stream, GROUP_PACKER) == 1  # the stale group was acked too; group 4 waits
        rows = [Metric.from_fields(f) for _, f in await b.redis.xrange(b.keys.metrics())]
        stale, built = rows  # the stale group is released at once, in its own commit
        assert stale.step == 5 and stale.values == {"packer/stale_groups": 1.0}
        assert built.step == 5 and built.values["packer/samples"] == 4 and built.values["packer/groups"] == 2
        assert "packer/stale_groups" not in built.values
        assert await b.state_get(LAST_STEP_FIELD) == "5"
        assert await b.state_get("inflight") == "2"  # stale + packed groups released; group 4 in flight


def start_packer(cfg_file: Path, pause_s: float | None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop(PAUSE_ENV, None)
    if pause_s is not None:
        env[PAUSE_ENV] = str(pause_s)
    return subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "packer", "@", str(cfg_file), "--consumer", "packer-0"],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )


def wait_for_line(proc: subprocess.Popen, needle: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if needle in line:
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"packer exited ({proc.returncode}) before logging {needle!r}")
    raise AssertionError(f"packer did not log {needle!r} within {timeout_s}s")


async def test_kill_9_between_read_and_commit_then_restart(bus, redis_url, run_name, model_dir, tmp_path):
    cfg_file = tmp_path / "cfg.toml"
    cfg_file.write_text(
        f'[run]\nname = "{run_name}"\n[redis]\nurl = "{redis_url}"\nblock_ms = 100\n'
        f'[model]\npath = "{model_dir}"\n[[env]]\nid = "reverse_text"\nname = "{ENV}"\ngroup_size = 2\n'
        f"[packer]\nbatch_size = 4\nseq_len = 32\n"
    )

    async def check():
        async with bus("test") as b:
            batches = await micro_batches(b, 1)
            stream = b.keys.filtered(ENV)
            return (
                batches,
                await b.state_get(LAST_STEP_FIELD),
                await pending(b, stream, GROUP_PACKER),
                await b.redis.exists(b.keys.batches(2)),
            )

    async with bus("test") as b:
        for uid in range(1, 4):  # 6 samples: one step of 4 (two groups), one group left over
            await b.publish(b.keys.filtered(ENV), group(uid, [float(uid), 0.0]))
    with start_packer(cfg_file, pause_s=60) as first:  # the with closes its stderr pipe and reaps it
        try:
            wait_for_line(first, "packer_commit_paused")
            first.send_signal(signal.SIGKILL)
            first.wait(10)
        finally:
            first.kill()
    batches, last_step, pending_count, _ = await check()
    assert batches == [] and last_step is None and pending_count == 3  # read, nothing committed

    with start_packer(cfg_file, pause_s=None) as second:
        try:
            wait_for_line(second, "batch_packed")
            time.sleep(0.5)  # a second build of step 1 would land now
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(10)
    batches, last_step, pending_count, has_step_2 = await check()
    assert last_step == "1" and not has_step_2
    assert sorted(mb.index for mb in batches) == list(range(batches[0].count))  # exactly one copy of step 1
    rewards = sorted(r for mb in batches for r in mb.rewards.tolist())
    assert rewards == [0.0, 0.0, 1.0, 2.0]  # groups 1 and 2, each sample once
    assert pending_count == 1  # group 3 stays pending for step 2; groups 1 and 2 acked


async def test_held_groups_stay_claimed_and_are_never_dead_lettered(bus, redis_url, run_name, model_dir):
    """A group held longer than claim_idle_ms (batch not full) is kept busy, not reclaimed and dead-lettered."""
    cfg = config(redis_url, run_name, model_dir)
    cfg.redis.claim_idle_ms = 300
    cfg.redis.max_deliveries = 1

    async with bus("test") as b:
        stream = b.keys.filtered(ENV)
        await b.state_set(inflight=4)
        await b.publish(stream, group(1, [1.0, 0.0]))
        worker = PackerWorker(cfg, worker="packer-0")
        await worker.setup()
        task = asyncio.create_task(worker.run())
        await asyncio.sleep(1.5)  # 5 × claim_idle_ms holding half a batch
        assert await b.redis.xlen(b.keys.dead()) == 0
        [row] = await b.redis.xpending_range(stream, GROUP_PACKER, min="-", max="+", count=10)
        assert row["consumer"] == b"packer-0" and row["times_delivered"] == 1
        await b.publish(stream, group(2, [0.0, 1.0]))
        while not await b.redis.exists(b.keys.batches(1)):
            await asyncio.sleep(0.05)
        worker.request_stop()
        await asyncio.wait_for(task, 5)
        await worker.close()
        assert await b.redis.xlen(b.keys.dead()) == 0
        assert sorted(r for mb in await micro_batches(b, 1) for r in mb.rewards.tolist()) == [0.0, 0.0, 1.0, 1.0]
        assert await pending(b, stream, GROUP_PACKER) == 0
        assert await b.state_get("inflight") == "0"


async def test_packs_a_smaller_step_when_the_inflight_cap_holds_everything_here(bus, redis_url, run_name,
                                                                                model_dir):
    """Cap 3, group_size 2, batch 4: the feeder cannot add a group to the 2 held samples, so step 1 packs them."""
    cfg = config(redis_url, run_name, model_dir)
    cfg.feeder.max_inflight_rollouts = 3

    async with bus("test") as b:
        await b.state_set(inflight=2)
        await b.publish(b.keys.filtered(ENV), group(1, [1.0, 0.0]))
        worker = PackerWorker(cfg, worker="packer-0")
        await worker.setup()
        task = asyncio.create_task(worker.run())
        while not await b.redis.exists(b.keys.batches(1)):
            await asyncio.sleep(0.05)
        worker.request_stop()
        await asyncio.wait_for(task, 5)
        await worker.close()
        assert sorted(r for mb in await micro_batches(b, 1) for r in mb.rewards.tolist()) == [0.0, 1.0]
        assert await b.state_get("inflight") == "0"


async def test_own_pending_entries_past_max_deliveries_go_dead_on_restart(bus, redis_url, run_name,
                                                                          model_dir):
    cfg = config(redis_url, run_name, model_dir)

    async with bus("test") as b:
        stream = b.keys.filtered(ENV)
        await b.state_set(inflight=4)
        poison = await b.publish(stream, group(1, [1.0, 0.0]))
        await b.publish(stream, group(2, [1.0, 0.0]))
        await b.ensure_group(stream, GROUP_PACKER)
        await b.redis.xreadgroup(GROUP_PACKER, "packer-0", {stream: ">"}, count=10)
        # the packer crashed on the first group max_deliveries times in a row
        await b.redis.xclaim(stream, GROUP_PACKER, "packer-0", 0, [poison], retrycount=cfg.redis.max_deliveries)
        worker = PackerWorker(cfg, worker="packer-0")
        await worker.setup()
        while worker._replay:
            await worker._read(reclaim=False)
        await worker.close()
        assert [h.group.task_id for h in worker.held] == [f"{ENV}:0:2"]
        (_, letter), = await b.read_fanout(b.keys.dead())
        assert letter.entry_id == poison and "delivered 6 times" in letter.reason
        assert await b.state_get("inflight") == "2"


@pytest.mark.parametrize("bad_id", [300, -4])
async def test_a_group_with_token_ids_outside_the_vocabulary_goes_dead(bus, redis_url, run_name, model_dir,
                                                                       bad_id):
    cfg = config(redis_url, run_name, model_dir)  # the model's vocabulary: 300 ids

    async with bus("test") as b:
        stream = b.keys.filtered(ENV)
        await b.state_set(inflight=4)
        bad = group(1, [1.0, 0.0])
        bad.samples[1].completion_ids = np.array([1, bad_id, 2, 3, 4], np.int32)
        await b.publish(stream, bad)
        await b.publish(stream, group(2, [1.0, 0.0]))
        worker = PackerWorker(cfg, worker="packer-0")
        await worker.setup()
        await read_all(worker)
        await worker.close()
        assert [h.group.task_id for h in worker.held] == [f"{ENV}:0:2"]
        (_, letter), = await b.read_fanout(b.keys.dead())
        assert f"token id {bad_id} is outside the vocabulary [0, 300)" in letter.reason
        assert await b.state_get("inflight") == "2"


async def test_a_second_group_for_the_same_task_is_dropped_and_counted(bus, redis_url, run_name, model_dir):
    cfg = config(redis_url, run_name, model_dir, batch_size=2)

    async with bus("test") as b:
        stream = b.keys.filtered(ENV)
        await b.state_set(inflight=4)
        await b.publish(stream, group(1, [1.0, 0.0]))
        await b.publish(stream, group(1, [0.5, 0.0]))  # the same task again: a bug upstream
        await b.publish(stream, group(2, [1.0, 0.0]))
        worker = PackerWorker(cfg, worker="packer-0")
        await worker.setup()
        await read_all(worker)
        await worker.build(1)
        await worker._read(reclaim=False)
        await worker.build(2)
        await worker.close()
        trained = [t for s in (1, 2) for mb in await micro_batches(b, s) for t in mb.task_ids if t]
        assert sorted(trained) == [f"{ENV}:0:1"] * 2 + [f"{ENV}:0:2"] * 2
        metrics = [Metric.from_fields(f).values for _, f in await b.redis.xrange(b.keys.metrics())]
        assert sum(m.get("packer/duplicate_groups", 0) for m in metrics) == 1
        assert await pending(b, stream, GROUP_PACKER) == 0
        assert await b.state_get("inflight") == "0"


async def test_a_group_of_a_task_packed_at_an_earlier_step_is_dropped_in_a_read_with_others(bus, redis_url,
                                                                                             run_name, model_dir):
    """The packed bits of a read's groups come from one pipeline: a late duplicate among new groups is still caught,
    and the new ones are held."""
    cfg = config(redis_url, run_name, model_dir, batch_size=2)

    async with bus("test") as b:
        stream = b.keys.filtered(ENV)
        await b.state_set(inflight=6)
        await b.publish(stream, group(1, [1.0, 0.0]))
        worker = PackerWorker(cfg, worker="packer-0")
        await worker.setup()
        await read_all(worker)
        await worker.build(1)
        for task in (2, 1, 3):  # task 1 again, after its step was committed: a bug upstream
            await b.publish(stream, group(task, [1.0, 0.0]))
        await worker._read(reclaim=False)
        await worker.close()
        assert [h.group.task_id for h in worker.held] == [f"{ENV}:0:2", f"{ENV}:0:3"]
        metrics = [Metric.from_fields(f).values for _, f in await b.redis.xrange(b.keys.metrics())]
        assert sum(m.get("packer/duplicate_groups", 0) for m in metrics) == 1


async def test_a_second_packer_waits_as_a_standby_and_takes_over_the_first_ones_groups(bus, redis_url,
                                                                                       run_name, model_dir):
    cfg = config(redis_url, run_name, model_dir, lease_ttl_s=0.6)

    async with bus("test") as b:
        stream = b.keys.filtered(ENV)
        await b.state_set(inflight=2)
        await b.publish(stream, group(1, [1.0, 0.0]))
        first, second = PackerWorker(cfg, worker="packer-a"), PackerWorker(cfg, worker="packer-b")
        await first.setup()
        await read_all(first)
        assert [h.group.task_id for h in first.held] == [f"{ENV}:0:1"]
        standby = asyncio.create_task(second.setup())
        await asyncio.sleep(0.2)
        assert not standby.done()  # a standby while the first one's lease lasts
        await asyncio.wait_for(standby, 5)  # the first one stopped renewing (it "died"): the lease expires
        while second._replay:
            await second._read(reclaim=False)
        assert [h.group.task_id for h in second.held] == [f"{ENV}:0:1"]  # taken over, not re-rolled
        owners = {p["consumer"].decode() for p in await b.redis.xpending_range(stream, GROUP_PACKER, "-", "+", 10)}
        assert owners == {"packer-b"}
        await second.close()
        await first.close()


async def test_a_dynamic_batch_takes_what_is_queued_up_to_max_batch_size(bus, redis_url, run_name, model_dir):
    cfg = config(redis_url, run_name, model_dir, max_batch_size=8)  # batch_size 4: two groups of 2 at least

    async with bus("test") as b:
        await b.state_set(**{"inflight": 12})
        await publish_trained(b, 0)
        stream = b.keys.filtered(ENV)
        for uid in range(1, 7):  # six groups (12 samples) queued before the packer looks
            await b.publish(stream, group(uid, [1.0, 0.0]))
        worker = PackerWorker(cfg, worker="packer-0")
        await worker.setup()
        task = asyncio.create_task(worker.run())
        while not await b.redis.exists(b.keys.batches(2)):
            await asyncio.sleep(0.05)
        worker.request_stop()
        await asyncio.wait_for(task, 5)
        await worker.close()
        rows = [Metric.from_fields(f) for _, f in await b.redis.xrange(b.keys.metrics())]
        assert [(m.step, m.values["packer/samples"]) for m in rows] == [(1, 8.0), (2, 4.0)]


async def test_end_of_data_counts_for_the_epochs_it_was_reached_with_and_repairs_a_lost_release(
        bus, redis_url, run_name, model_dir):
    from bus.state import (
        DATA_EXHAUSTED,
        EXHAUSTED_EPOCHS_FIELD,
        FEEDER_DONE_FIELD,
        STOP_REASON_FIELD,
        exhausted_at,
    )

    cfg = config(redis_url, run_name, model_dir).model_copy(deep=True)
    cfg.feeder.max_epochs = 2

    async with bus("test") as b:
        # an earlier run with max_epochs = 1 ran out; resumed with max_epochs = 2 it is not over, even once the
        # feeder has issued its last task (feeder:done = 2) and the old stop reason is still there
        await b.state_set(**{"inflight": 0, FEEDER_DONE_FIELD: 2, STOP_REASON_FIELD: DATA_EXHAUSTED,
                             EXHAUSTED_EPOCHS_FIELD: 1})
        assert await exhausted_at(b, 2) is None and await exhausted_at(b, 1) == 0
        await publish_trained(b, 0)
        await b.publish(b.keys.filtered(ENV), group(1, [1.0, 0.0]))
        # now both epochs are out; one group's release was lost (inflight says 2 more than the streams hold)
        await b.state_set(**{"inflight": 4, FEEDER_DONE_FIELD: 2})
        worker = PackerWorker(cfg, worker="packer-0")
        await worker.setup()
        await asyncio.wait_for(worker.run(), 30)  # returns by itself: the last, partial step, then done
        await worker.close()
        assert await exhausted_at(b, 2) == 1
        assert [mb.step for mb in await micro_batches(b, 1)] and await b.state_get("inflight") == "0"


async def test_sft_groups_are_never_stale(bus, redis_url, run_name, model_dir):
    cfg = config(redis_url, run_name, model_dir, max_off_policy_steps=0)

    async with bus("test") as b:
        await b.state_set(**{LAST_STEP_FIELD: 4, "inflight": 4})
        await publish_trained(b, 4)
        old = group(1, [1.0, 0.0], version=0)  # four versions behind: stale for rl, not for sft
        sft = [x.replace(mode="sft") for x in old.samples]
        await b.publish(b.keys.filtered(ENV), old.replace(mode="sft", samples=sft))
        await b.publish(b.keys.filtered(ENV), group(2, [1.0, 0.0], version=0))
        worker = PackerWorker(cfg, worker="packer-0")
        await worker.setup()
        await read_all(worker)
        worker._drop_stale(5)
        assert [h.group.task_id for h in worker.held] == [f"{ENV}:0:1"]
        assert [h.group.task_id for h in worker.stale] == [f"{ENV}:0:2"]
        await worker.close()


async def test_a_packer_rides_out_a_redis_outage_longer_than_its_lease(tmp_path, run_name, model_dir):
    """Redis away for four lease TTLs (within redis.reconnect_timeout_s): the packer keeps its lease and builds the
    next step once Redis is back, instead of stopping after one TTL."""
    server = LocalRedis(dir=tmp_path / "redis")
    url = server.start()
    cfg = config(url, run_name, model_dir, lease_ttl_s=0.5)

    try:
        b = await Bus.connect(url, run_name, RedisConfig(url=url), "test")
        worker = PackerWorker(cfg, worker="packer")
        try:
            await b.state_set(inflight=4)
            await worker.setup()
            running = asyncio.create_task(worker.run())
            await asyncio.sleep(0.3)
            server = await asyncio.to_thread(redis_outage, server, tmp_path / "redis", 2.0)
            await b.publish_many(b.keys.filtered(ENV), [group(1, [1.0, 0.0]), group(2, [0.0, 1.0])])
            deadline = time.monotonic() + 20
            while not await b.redis.exists(b.keys.batches(1)) and time.monotonic() < deadline:
                assert not running.done(), running.result()
                await asyncio.sleep(0.05)
            assert len(await micro_batches(b, 1)) > 0
            while await b.redis.get(worker.lease.key) is None and time.monotonic() < deadline:  # expired meanwhile
                assert not running.done(), running.result()
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # a renewal or so later, still the holder
            assert not running.done(), running.result()
            assert (await b.redis.get(worker.lease.key)).decode() == worker.lease.holder
            worker.request_stop()
            await asyncio.wait_for(running, 5)
        finally:
            await worker.close()
            await b.close()
    finally:
        server.stop()
