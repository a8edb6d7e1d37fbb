"""A lease: one holder at a time for a role that must not run twice (the packer), the others wait as standbys.

The holder SETs ``lease:{role}`` with a TTL and renews it every third of it, only while the key still names it
(compare-and-expire in one script). A holder that cannot renew — its lease expired while it was stalled, or Redis
is gone — stops at once; a standby takes the key when it expires and, before it starts, takes over the pending
entries the old holder left (the commit's ownership check refuses any late write of the old one).
"""

import asyncio

from bus.errors import RlbusError
from bus.streams import Bus

_RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaseLost(RlbusError):
    """The lease expired or another holder has it: this worker must stop."""


class Lease:
    """The lease of ``role`` in one run, held (or waited for) by ``holder``."""

    def __init__(self, bus: Bus, role: str, holder: str, ttl_s: float):
        self.bus, self.holder, self.ttl_ms = bus, holder, int(ttl_s * 1000)
        self.key = bus.keys.lease(role)

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait (as a standby) until the lease is ours; False when ``stop`` is set first."""
        while not stop.is_set():
            if await self.bus.redis.set(self.key, self.holder, nx=True, px=self.ttl_ms):
                return True
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.ttl_ms / 3000)
            except TimeoutError:
                pass
        return False

    async def keep(self) -> None:
        """Forever: renew every third of the TTL; raises :class:`LeaseLost` when the lease is no longer ours."""
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            if not await self.bus.redis.eval(_RENEW_LUA, 1, self.key, self.holder, self.ttl_ms):
                owner = await self.bus.redis.get(self.key)
                raise LeaseLost(f"{self.key} is no longer held by {self.holder} (now: {owner!r}); stopping so that "
                                "only one holder works")

    async def release(self) -> None:
        """Give the lease up now (a clean stop), so a standby takes over without waiting for the TTL."""
        await self.bus.redis.eval(_RELEASE_LUA, 1, self.key, self.holder)
