"""Leases against a real redis-server: a holder rides out a Redis outage longer than its TTL, holders are told
apart by process (not by name), and a holder that makes no progress lets its lease go."""

import asyncio

import pytest
from structlog.testing import capture_logs

from bus.config import RedisConfig
from bus.lease import Lease, LeaseLost, process_holder
from bus.local_redis import LocalRedis
from bus.streams import Bus
from tests.outages import redis_outage

TTL_S = 1.0


@pytest.mark.parametrize("renewer", ["task", "thread"])
async def test_a_holder_rides_out_a_redis_outage_longer_than_its_ttl(tmp_path, renewer):
    """The packer renews from a task, the trainer from a thread: each keeps its lease through a restart of Redis
    three TTLs long (within redis.reconnect_timeout_s), as through the 15 s one the docs promise to ride out."""
    server = LocalRedis(dir=tmp_path)
    url = server.start()
    bus = await Bus.connect(url, "outage", RedisConfig(url=url, reconnect_timeout_s=30), "holder")
    lease = Lease(bus, "packer", process_holder("holder"), TTL_S)
    try:
        assert await lease.acquire(asyncio.Event())
        if renewer == "task":
            kept = asyncio.create_task(lease.keep())
            check = lambda: kept.result() if kept.done() else None  # noqa: E731
        else:
            keeper = lease.keep_in_thread(url, None, progress_timeout_s=60)
            check = keeper.check
        with capture_logs() as logs:
            server = await asyncio.to_thread(redis_outage, server, tmp_path, 3 * TTL_S)
            await asyncio.sleep(2 * TTL_S)  # back: the holder renews (re-takes the key that expired meanwhile)
        check()
        assert (await bus.redis.get(lease.key)).decode() == lease.holder
        retaken = [e for e in logs if e["event"] == "lease_retaken"]  # what an operator greps for
        assert retaken and all((e["key"], e["holder"]) == (lease.key, lease.holder) for e in retaken), retaken
    finally:
        if renewer == "task":
            kept.cancel()
        else:
            keeper.close()
        await bus.close()
        server.stop()


async def test_a_holder_that_finds_the_lease_taken_while_redis_was_away_stops(bus):
    async with bus("a") as a, bus("b") as b:
        first = Lease(a, "packer", process_holder("packer"), TTL_S)
        second = Lease(b, "packer", process_holder("packer"), TTL_S)
        assert await first.acquire(asyncio.Event())
        await a.redis.delete(first.key)  # it expired while the holder could not renew
        assert await second.acquire(asyncio.Event())
        with pytest.raises(LeaseLost, match="no longer held by"):
            await asyncio.wait_for(first.keep(), 3 * TTL_S)


async def test_two_holders_of_the_same_name_are_two_holders(bus):
    """Two packers started with the default consumer name: after the first stalls past its TTL the second holds the
    lease; the first, awake again, must stop (not go on beside it), and its clean stop must not end the second's."""
    async with bus("packer") as a, bus("packer") as b:
        first = Lease(a, "packer", process_holder("packer"), TTL_S)
        second = Lease(b, "packer", process_holder("packer"), TTL_S)
        assert first.holder != second.holder
        assert await first.acquire(asyncio.Event())
        standby = asyncio.create_task(second.acquire(asyncio.Event()))
        assert await asyncio.wait_for(standby, 3 * TTL_S)  # the first stalled: no renewal, the lease expired
        with pytest.raises(LeaseLost):
            await asyncio.wait_for(first.keep(), 3 * TTL_S)
        await first.release()
        assert (await b.redis.get(second.key)).decode() == second.holder
        kept = asyncio.create_task(second.keep())
        await asyncio.sleep(TTL_S)
        assert not kept.done()
        kept.cancel()


def test_holders_differ_by_process_and_name_what_they_are():
    holder = process_holder("packer")
    assert holder.startswith("packer@") and holder != process_holder("packer")
