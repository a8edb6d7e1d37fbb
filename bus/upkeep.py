"""Upkeep of the consumer-group streams, a part of :class:`bus.streams.Bus`: keeping the entries a worker holds
its own (:meth:`GroupUpkeep.keep_claimed`), taking over a dead holder's (:meth:`GroupUpkeep.take_over`), and
trimming what every group has consumed (:meth:`GroupUpkeep.trim_consumed`).
"""

import asyncio
import time
from collections.abc import Callable, Iterable

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError, ResponseError
from structlog.typing import FilteringBoundLogger

from bus.config import RedisConfig
from bus.entries import entry_order
from bus.errors import RlbusError
from bus.resp import as_str

TRIM_INTERVAL_S = 5.0
"""How often a consuming stage trims its input streams behind their slowest group."""


class GroupUpkeep:
    """The consumer-group upkeep of :class:`bus.streams.Bus` (which sets these attributes)."""

    redis: aioredis.Redis
    cfg: RedisConfig
    worker: str
    log: FilteringBoundLogger
    _renew_script: AsyncScript
    _trimmed_at: float

    async def keep_claimed(
        self,
        group: str,
        held: Callable[[], Iterable[tuple[str, str]]],
        on_lost: Callable[[tuple[str, str]], None] | None = None,
    ) -> None:
        """Forever: every ``claim_idle_ms / 3``, reset the idle time of each ``(stream, id)`` of ``held()`` that
        this consumer still owns (XCLAIM JUSTID: the delivery count stays), so entries still being worked on never
        look idle to another consumer's :meth:`reclaim`. An entry another consumer took meanwhile is left with it
        and passed to ``on_lost``. Redis errors are retried; when renewing has failed for ``claim_idle_ms`` the
        held entries may already be someone else's, and this raises: the worker must stop. Run it beside the
        worker's loop (``run_until_first``)."""
        period_s = self.cfg.claim_idle_ms / 3000
        failing_since: float | None = None
        while True:
            await asyncio.sleep(period_s)
            entries = list(held())
            try:
                lost = await self._renew(group, entries)
            except (RedisError, OSError) as e:
                now = time.monotonic()
                failing_since = failing_since or now
                self.log.warning("keep_alive_failed", group=group, error=str(e))
                if now - failing_since >= self.cfg.claim_idle_ms / 1000:
                    raise RlbusError(f"keep-alive failed for {now - failing_since:.1f}s (redis.claim_idle_ms="
                                     f"{self.cfg.claim_idle_ms}): the entries this worker holds may be reclaimed by "
                                     f"another; stopping ({e})") from e
                continue
            failing_since = None
            for stream, entry_id in lost:
                self.log.warning("entry_lost", stream=stream, entry_id=entry_id, hint="another consumer reclaimed it")
                if on_lost is not None:
                    on_lost((stream, entry_id))

    async def _renew(self, group: str, entries: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Renew the entries this consumer owns; the ones it no longer owns."""
        if not entries:
            return []
        lost = await self._renew_script(keys=[s for s, _ in entries],
                                        args=[group, self.worker, *(i for _, i in entries)])
        return [entries[int(k)] for k in lost]

    async def take_over(self, stream: str, group: str) -> int:
        """Claim every pending entry of ``group`` on ``stream`` for this consumer at once (JUSTID: delivery counts
        stay); for a standby that just took a lease, so the dead holder's entries need not wait ``claim_idle_ms``.
        Returns how many were claimed."""
        claimed, low = 0, "-"
        while True:
            try:
                rows = await self.redis.xpending_range(stream, group, min=low, max="+", count=1000)
            except ResponseError as e:
                if "NOGROUP" in str(e):
                    return claimed
                raise
            theirs = [row["message_id"] for row in rows if as_str(row["consumer"]) != self.worker]
            if theirs:
                await self.redis.xclaim(stream, group, self.worker, 0, theirs, justid=True)
                claimed += len(theirs)
            if len(rows) < 1000:
                return claimed
            low = "(" + as_str(rows[-1]["message_id"])

    async def trim_consumed(self, stream: str) -> int:
        """XTRIM MINID behind the slowest consumer group of ``stream``: only entries every group has been delivered
        and has acked go (a group's floor is its oldest pending entry, else its last delivered one). Entries
        delivered or added meanwhile have larger ids than any floor read here, so they are never trimmed.
        Returns how many entries were removed."""
        try:
            groups = await self.redis.xinfo_groups(stream)
        except ResponseError:  # no such stream yet
            return 0
        floors = []
        for group in groups:
            floor = as_str(group["last-delivered-id"])
            if group["pending"]:
                oldest = (await self.redis.xpending(stream, group["name"]))["min"]
                if oldest is not None:  # None: acked since XINFO; the floor read then is still safe
                    floor = min(floor, as_str(oldest), key=entry_order)
            floors.append(floor)
        if not floors:
            return 0
        return int(await self.redis.xtrim(stream, minid=min(floors, key=entry_order), approximate=False))

    async def trim_consumed_every(self, streams: Iterable[str], interval_s: float = TRIM_INTERVAL_S) -> None:
        """:meth:`trim_consumed` each of ``streams``, at most once every ``interval_s`` (call it from a loop)."""
        now = time.monotonic()
        if now - self._trimmed_at < interval_s:
            return
        self._trimmed_at = now
        for stream in streams:
            await self.trim_consumed(stream)
