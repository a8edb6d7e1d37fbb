"""The policy tracker: trained and served versions."""

import asyncio
import time

import pytest

from bus.policy import PolicyTracker, heartbeat, publish_served, server_stopped
from tests.policy import publish_trained


async def test_policy_tracker(bus):
    async with bus("trainer") as b, bus("rollout") as r:
        tracker = PolicyTracker(r)
        await tracker.refresh()
        assert (tracker.trained, tracker.served) == (0, 0)
        await publish_trained(b, 1)
        await publish_served(b, "s0", 1)
        await publish_served(b, "s1", 0)
        assert await tracker.refresh()
        assert (tracker.trained, tracker.served, tracker.served_by) == (1, 0, {"s0": 1, "s1": 0})
        with pytest.raises(TimeoutError, match="served_by"):
            await tracker.wait(lambda t: t.served >= 1, timeout_s=0.2)

        async def later():
            await asyncio.sleep(0.1)
            await publish_served(b, "s1", 1)

        started = time.monotonic()
        await asyncio.gather(tracker.wait(lambda t: t.served >= 1, timeout_s=5), later())
        assert tracker.served == 1 and time.monotonic() - started < 3


async def test_only_live_servers_count_toward_served(bus):
    """A server scaled down stops its heartbeat; once its TTL passes it no longer pins ``served``."""

    async with bus("trainer") as b, bus("rollout") as r:
        await publish_served(b, "gone", 1)
        await publish_served(b, "stays", 4)
        tracker = PolicyTracker(r, server_ttl_s=0.5)
        await tracker.refresh()
        assert tracker.served == 1 and tracker.live == {"gone", "stays"}
        for _ in range(4):
            await asyncio.sleep(0.2)
            await heartbeat(b, "stays")
        await tracker.refresh()
        assert tracker.served == 4 and tracker.live == {"stays"}
        assert tracker.served_by == {"gone": 1, "stays": 4}  # still reported, not counted
        await server_stopped(b, "stays")
        await asyncio.sleep(0.15)  # the live set is re-read at most every server_ttl_s / 5 without new events
        await tracker.refresh()
        assert tracker.live == set() and tracker.served == 0
