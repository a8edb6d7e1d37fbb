"""A lease: one holder at a time for a role that must not run twice (packer, trainer), the others wait as standbys.

The holder SETs ``lease:{role}`` to its :func:`process_holder` id (name, host, pid and a random part, so two
processes started with the same name are two holders) with a TTL, and renews it every third of it while the key
still names it (compare-and-expire in one script). A key that expired while Redis was away (a restart, an outage
longer than the TTL) is taken again by its holder if nobody else took it meanwhile; a key that names another
holder means the lease is lost and the holder stops at once; so does Redis staying away past
``redis.reconnect_timeout_s``. A standby takes the key when it expires and, before it starts, takes over the
pending entries the old holder left (the commit's ownership check and guards refuse any late write of the old one).

A holder whose loop blocks for long stretches (the trainer, in a step or a checkpoint save) renews from a thread
with its own connection instead (:meth:`Lease.keep_in_thread`), so a long step never looks like a dead holder; the
thread renews only while the holder reports progress (:meth:`LeaseKeeper.progress`) within a bound, so a wedged
holder (a hung collective, stuck storage) lets the lease lapse and a standby takes over.
"""

import asyncio
import os
import socket
import threading
import time
import uuid

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from bus.clients import close_sync_client, sync_client
from bus.errors import RlbusError
from bus.streams import Bus

_RENEW_LUA = """
local owner = redis.call('GET', KEYS[1])
if owner == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if owner then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 2
"""
"""1: renewed; 2: it had expired (Redis was away, or the holder stalled) and nobody took it: taken again; 0: another
holder has it."""

_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaseLost(RlbusError):
    """Another holder has the lease, or it could not be renewed for ``redis.reconnect_timeout_s``: this worker must
    stop."""


def process_holder(name: str) -> str:
    """A holder id for worker ``name`` unique to this process: ``{name}@{host}:{pid}:{random}``."""
    return f"{name}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Lease:
    """The lease of ``role`` in one run, held (or waited for) by ``holder``."""

    def __init__(self, bus: Bus, role: str, holder: str, ttl_s: float):
        self.bus, self.holder, self.ttl_ms = bus, holder, int(ttl_s * 1000)
        self.key = bus.keys.lease(role)
        self.reconnect_timeout_s = bus.cfg.reconnect_timeout_s

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
        """Forever: renew every third of the TTL; raises :class:`LeaseLost` when the lease is another holder's (a
        Redis error propagates once the bus's client gave up retrying, after ``redis.reconnect_timeout_s``)."""
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            if not self._renewed(await self.bus.redis.eval(_RENEW_LUA, 1, self.key, self.holder, self.ttl_ms)):
                raise LeaseLost(f"{self.key} is no longer held by {self.holder}; "
                                "stopping so that only one holder works")

    def _renewed(self, reply: int) -> bool:
        """Whether a reply of :data:`_RENEW_LUA` leaves the lease ours (a retaking is logged)."""
        if reply == 2:
            self.bus.log.warning("lease_retaken", key=self.key, holder=self.holder,
                                 hint="it expired while Redis was away or this holder stalled; nobody took it")
        return bool(reply)

    def keep_in_thread(self, url: str, password: str | None, progress_timeout_s: float) -> "LeaseKeeper":
        """Renew from a daemon thread over its own connection while :meth:`LeaseKeeper.progress` was called within
        ``progress_timeout_s``; call :meth:`LeaseKeeper.check` between steps. Each renewal is one try (the thread
        retries every third of the TTL itself, up to ``redis.reconnect_timeout_s``)."""
        client = sync_client(url, password=password, socket_timeout=self.ttl_ms / 3000, retry=Retry(NoBackoff(), 0))
        keeper = LeaseKeeper(self, client, progress_timeout_s)
        keeper.start()
        return keeper

    async def release(self) -> None:
        """Give the lease up now (a clean stop), so a standby takes over without waiting for the TTL."""
        await self.bus.redis.eval(_RELEASE_LUA, 1, self.key, self.holder)


class LeaseKeeper(threading.Thread):
    """The renewing thread of a :class:`Lease`: every third of the TTL, compare-and-expire (or take again, see
    :data:`_RENEW_LUA`) while the holder made progress within ``progress_timeout_s``; a lease another holder has, or
    that could not be renewed for ``redis.reconnect_timeout_s`` (Redis away), is lost for good."""

    def __init__(self, lease: Lease, client: redis.Redis, progress_timeout_s: float):
        super().__init__(name=f"lease-{lease.key}", daemon=True)
        self.lease, self.client, self.progress_timeout_s = lease, client, progress_timeout_s
        self.lost: str | None = None
        """Why the lease was lost (None while it is held)."""
        self._progressed_at = time.monotonic()
        self._lapsed = False
        self._closing = threading.Event()

    def progress(self) -> None:
        """The holder's loop moved on: renewing goes on for another ``progress_timeout_s``."""
        self._progressed_at = time.monotonic()

    def _stalled(self) -> bool:
        """Whether the holder made no progress for ``progress_timeout_s`` (logged once per stall)."""
        idle_s = time.monotonic() - self._progressed_at
        stalled = idle_s > self.progress_timeout_s
        if stalled and not self._lapsed:
            self.lease.bus.log.warning("lease_lapsing", key=self.lease.key, idle_s=round(idle_s, 1),
                                       hint="no progress within the bound: the lease is left to expire for a standby")
        self._lapsed = stalled
        return stalled

    def run(self) -> None:
        lease, failing_since = self.lease, None
        while not self._closing.wait(lease.ttl_ms / 3000):
            if self._stalled():
                continue
            try:
                renewed = self.client.eval(_RENEW_LUA, 1, lease.key, lease.holder, lease.ttl_ms)
            except (RedisError, OSError) as e:
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since >= lease.reconnect_timeout_s:
                    self.lost = (f"{lease.key} could not be renewed for {lease.reconnect_timeout_s:.0f} s "
                                 f"(redis.reconnect_timeout_s; {e})")
                    return
                continue
            failing_since = None
            if not lease._renewed(renewed):
                self.lost = f"{lease.key} is no longer held by {lease.holder}"
                return

    def check(self) -> None:
        """Raise :class:`LeaseLost` once the lease is lost."""
        if self.lost is not None:
            raise LeaseLost(f"{self.lost}; stopping so that only one holder works")

    def close(self) -> None:
        self._closing.set()
        self.join(timeout=5)
        close_sync_client(self.client)
