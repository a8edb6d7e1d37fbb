"""Reads of the fan-out streams (no consumer group: ``weights``, ``policy``, ``metrics``, ``dead``), a part of
:class:`bus.streams.Bus`.

Every reader sees every entry and keeps its own place in the stream. An entry that cannot be decoded (or is
larger than ``redis.max_entry_bytes``) is logged and skipped: a fan-out entry has no owner to dead-letter it.
"""

from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from structlog.typing import FilteringBoundLogger

from bus.codec import Message
from bus.config import RedisConfig
from bus.entries import oversize_reason
from bus.errors import DecodeError
from bus.keys import Keys
from bus.messages import decode
from bus.resp import as_str
from bus.wakeup import BlockedReads


def warn_if_lagging(log: FilteringBoundLogger, cfg: RedisConfig, replicas: int) -> None:
    """Log ``replication_lagging`` when fewer than ``redis.wait_replicas`` replicas acknowledged a WAIT."""
    if replicas < cfg.wait_replicas:
        log.warning("replication_lagging", replicas=replicas, wanted=cfg.wait_replicas, waited_ms=cfg.wait_timeout_ms)


class FanoutReads:
    """The fan-out reads of :class:`bus.streams.Bus` (which sets these attributes)."""

    redis: aioredis.Redis
    keys: Keys
    cfg: RedisConfig
    worker: str
    log: FilteringBoundLogger
    blocked: BlockedReads
    """This worker's blocking reads: :meth:`bus.streams.Bus.wake_blocked_reads` ends them."""

    async def read_fanout(
        self, stream: str, last_id: str = "0", count: int = 100, block_ms: int | None = None, *,
        replicated: bool = False,
    ) -> list[tuple[str, Message]]:
        """XREAD entries after ``last_id``; undecodable entries are logged and skipped.

        ``replicated`` is for a reader that keeps what it reads (``metrics.jsonl``): with ``redis.wait_replicas``
        set, the entries come back only once that many replicas hold them (or ``wait_timeout_ms`` passed, logged
        ``replication_lagging``), so a failover cannot take back an entry the reader already kept. The XREAD, a
        PUBLISH on ``keys.barrier()`` (a write that stores nothing: WAIT then covers every write before the read)
        and the WAIT go in one pipeline, which redis-py retries whole on the promoted primary, never the read alone.
        """
        while True:
            reply = await self._xread(stream, last_id, count, block_ms, replicated and self.cfg.wait_replicas > 0)
            if not reply:
                return []
            out = self._decode_rows(stream, reply[0][1], "fanout_entry_undecodable")
            if out:
                return out
            last_id, block_ms = as_str(reply[0][1][-1][0]), None

    async def _xread(self, stream: str, last_id: str, count: int, block_ms: int | None, replicated: bool) -> Any:
        if not replicated:
            return await self.blocked.read(self.redis.xread({stream: last_id}, count=count, block=block_ms), block_ms)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xread({stream: last_id}, count=count, block=block_ms)
        pipe.publish(self.keys.barrier(), self.worker)
        pipe.wait(self.cfg.wait_replicas, self.cfg.wait_timeout_ms)
        replies = await self.blocked.read(pipe.execute(), block_ms)
        if replies is None:
            return None
        reply, _, replicas = replies
        warn_if_lagging(self.log, self.cfg, replicas)
        return reply

    async def read_range(
        self, stream: str, low: str = "-", high: str = "+", count: int | None = None, *, newest_first: bool = False
    ) -> list[tuple[str, Message]]:
        """The entries of ``stream`` from ``low`` to ``high`` (XRANGE; ``newest_first``: XREVRANGE, at most ``count``
        from ``high`` down), undecodable ones logged and skipped."""
        if newest_first:
            rows = await self.redis.xrevrange(stream, max=high, min=low, count=count)
        else:
            rows = await self.redis.xrange(stream, min=low, max=high, count=count)
        return self._decode_rows(stream, rows, "entry_undecodable")

    async def read_all(self, stream: str, low: str = "-", chunk: int = 500) -> AsyncIterator[tuple[str, Message]]:
        """Every entry of ``stream`` from ``low`` on, oldest first, read ``chunk`` per XRANGE; undecodable ones
        logged and skipped."""
        while True:
            rows = await self.redis.xrange(stream, min=low, count=chunk)
            for item in self._decode_rows(stream, rows, "entry_undecodable"):
                yield item
            if len(rows) < chunk:
                return
            low = "(" + as_str(rows[-1][0])

    async def read_headers(
        self, last_ids: dict[str, str], count: int, block_ms: int | None
    ) -> list[tuple[str, str, dict[bytes, bytes]]]:
        """XREAD each stream after its ``last_ids`` entry without decoding: ``(stream, id, fields)`` of each entry,
        for a reader that looks only at header fields (the feeder, woken by releases). Nothing is decoded, so
        there is nothing to size-check or skip."""
        reply = await self.blocked.read(self.redis.xread(last_ids, count=count, block=block_ms), block_ms)
        return [(as_str(stream), as_str(raw_id), fields) for stream, rows in reply or [] for raw_id, fields in rows]

    async def last(self, stream: str, scan: int = 100) -> tuple[str, Message] | None:
        """The newest entry of ``stream`` that decodes (among the newest ``scan``), or None when there is none."""
        for raw_id, fields in await self.redis.xrevrange(stream, count=scan):
            try:
                return as_str(raw_id), self._decode_fanout(fields)
            except DecodeError as e:
                self.log.error("entry_undecodable", stream=stream, entry_id=as_str(raw_id), error=str(e))
        return None

    async def last_id(self, stream: str) -> str:
        """The id of the newest entry of ``stream`` ("0" when it has none): where a reader of new entries starts."""
        rows = await self.redis.xrevrange(stream, count=1)
        return as_str(rows[0][0]) if rows else "0"

    def _decode_rows(self, stream: str, rows: list, event: str) -> list[tuple[str, Message]]:
        out = []
        for raw_id, fields in rows:
            try:
                out.append((as_str(raw_id), self._decode_fanout(fields)))
            except DecodeError as e:
                self.log.error(event, stream=stream, entry_id=as_str(raw_id), error=str(e))
        return out

    def _decode_fanout(self, fields: dict[bytes, bytes]) -> Message:
        oversize = oversize_reason(fields, self.cfg.max_entry_bytes)
        if oversize is not None:
            raise DecodeError(oversize)
        return decode(fields)
