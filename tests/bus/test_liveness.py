"""Worker heartbeats (bus/liveness.py): beats land in `workers` scored by Redis's clock, a clean stop leaves the set,
and stopping never hangs, whatever the beat was doing when the stop came."""

import asyncio
import random

import pytest

from bus.liveness import member, worker_beats


async def test_a_beat_lands_and_a_clean_stop_leaves(bus):
    async with bus("filter-a", heartbeat_s=0.05) as b:
        b.start_heartbeat()
        await asyncio.sleep(0.2)
        beats = await worker_beats(b.redis, b.keys.workers())
        assert [(x.worker, x.role) for x in beats] == [("filter-a", "filter")] and beats[0].age_s < 1
        key = b.keys.workers()
    async with bus("probe") as b:
        assert await b.redis.zscore(key, member("filter-a")) is None


@pytest.mark.timeout(60)
async def test_stopping_a_heartbeat_mid_beat_never_hangs(bus):
    # A cancellation that lands inside redis-py's call can come back as a timeout error; the first version took it
    # for Redis being away and kept beating, and its stop() waited for it forever (a worker whose setup failed hung).
    async with asyncio.timeout(50):
        for i in range(200):
            async with bus(f"filter-{i}", heartbeat_s=0.001) as b:
                b.start_heartbeat()
                await asyncio.sleep(random.random() * 0.005)
