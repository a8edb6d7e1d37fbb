"""A lease: one holder at a time for a role that must not run twice (packer, trainer), the others wait as standbys.

The holder SETs ``lease:{role}`` with a TTL and renews it every third of it, only while the key still names it
(compare-and-expire in one script). A holder that cannot renew — its lease expired while it was stalled, or Redis
is gone — stops at once; a standby takes the key when it expires and, before it starts, takes over the pending
entries the old holder left (the commit's ownership check refuses any late write of the old one).

A holder whose loop blocks for long stretches (the trainer, in a step or a checkpoint save) renews from a thread
with its own connection instead (:meth:`Lease.keep_in_thread`), so a long step never looks like a dead holder.
"""

import asyncio
import threading
import time

import redis
from redis.exceptions import RedisError

from bus.clients import sync_client
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

    def keep_in_thread(self, url: str, password: str | None) -> "LeaseKeeper":
        """Renew from a daemon thread over its own connection; check :meth:`LeaseKeeper.check` between steps."""
        keeper = LeaseKeeper(self, sync_client(url, password=password, socket_timeout=self.ttl_ms / 3000))
        keeper.start()
        return keeper

    async def release(self) -> None:
        """Give the lease up now (a clean stop), so a standby takes over without waiting for the TTL."""
        await self.bus.redis.eval(_RELEASE_LUA, 1, self.key, self.holder)


class LeaseKeeper(threading.Thread):
    """The renewing thread of a :class:`Lease`: every third of the TTL, compare-and-expire; a lease another holder
    has, or that could not be renewed for a whole TTL (Redis away), is lost for good."""

    def __init__(self, lease: Lease, client: redis.Redis):
        super().__init__(name=f"lease-{lease.key}", daemon=True)
        self.lease, self.client = lease, client
        self.lost: str | None = None
        """Why the lease was lost (None while it is held)."""
        self._closing = threading.Event()

    def run(self) -> None:
        lease, failing_since = self.lease, None
        while not self._closing.wait(lease.ttl_ms / 3000):
            try:
                renewed = self.client.eval(_RENEW_LUA, 1, lease.key, lease.holder, lease.ttl_ms)
            except (RedisError, OSError) as e:
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since >= lease.ttl_ms / 1000:
                    self.lost = f"{lease.key} could not be renewed for {lease.ttl_ms / 1000:.0f} s ({e})"
                    return
                continue
            failing_since = None
            if not renewed:
                self.lost = f"{lease.key} is no longer held by {lease.holder}"
                return

    def check(self) -> None:
        """Raise :class:`LeaseLost` once the lease is lost."""
        if self.lost is not None:
            raise LeaseLost(f"{self.lost}; stopping so that only one holder works")

    def close(self) -> None:
        self._closing.set()
        self.join(timeout=5)
        self.client.close()
