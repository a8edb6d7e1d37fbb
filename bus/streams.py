"""The bus: Redis streams with consumer groups, dead letters and atomic commits (asyncio, redis-py + hiredis).

A consuming stage reads with :meth:`Bus.read_group`, does its work, then :meth:`Bus.commit`\\ s the
acks of its inputs together with its outputs in one atomic Lua script (:mod:`bus.commit`) that writes
only while the stage still owns those inputs, so a stage never half-commits and never commits twice.
Entries a dead consumer left pending come back through :meth:`Bus.reclaim`; entries that cannot be
decoded, or were delivered more than ``max_deliveries`` times, go to the run's ``dead`` stream.

``block_ms`` everywhere follows redis-py: None returns at once, N blocks up to N ms (0 = forever).
"""

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from bus.clients import async_client, close_async_client
from bus.codec import Message
from bus.commit import (
    COMMIT_LUA,
    RENEW_LUA,
    CommandRecorder,
    CommitConflict,
    NotOwned,
    commit_args,
    record_ttl_ms,
)
from bus.config import RedisConfig, redact, redis_password
from bus.entries import Entry, cut, oversize_reason
from bus.errors import DecodeError, RlbusError
from bus.fanout import FanoutReads, warn_if_lagging
from bus.keys import Keys
from bus.liveness import WorkerHeartbeat
from bus.log import get_logger
from bus.messages import DeadLetter, decode
from bus.resp import as_str, fast_packing
from bus.upkeep import GroupUpkeep
from bus.wakeup import BlockedReads

Skip = Callable[[dict[bytes, bytes]], bool] | None
"""Which raw entries a group read acks without decoding (None: none)."""

RECONNECT_BASE_S = 0.1
"""First wait before retrying a Redis call that failed to connect; it doubles per try."""
RECONNECT_MAX_S = 5.0
"""Longest wait between two tries."""


def reconnect_tries(timeout_s: float) -> int:
    """Retries whose backoff waits (0.1 s, 0.2 s, … capped at 5 s) add up to at least ``timeout_s``."""
    tries, waited, wait = 0, 0.0, RECONNECT_BASE_S
    while waited < timeout_s:
        tries, waited, wait = tries + 1, waited + wait, min(wait * 2, RECONNECT_MAX_S)
    return tries


class Bus(FanoutReads, GroupUpkeep):
    """One worker's connection to one run's streams: publishing, consumer-group reads, dead letters, commits and
    the state hash here; fan-out reads in :class:`bus.fanout.FanoutReads`, claims and trimming in
    :class:`bus.upkeep.GroupUpkeep`."""

    def __init__(self, client: aioredis.Redis, run: str, cfg: RedisConfig, worker: str):
        self.redis = client
        self.keys = Keys(run)
        self.cfg = cfg
        self.worker = worker
        self.log = get_logger(worker=worker, run=run)
        self._trimmed_at = 0.0
        self._commit_script = client.register_script(COMMIT_LUA)
        self._renew_script = client.register_script(RENEW_LUA)
        self._heartbeat: WorkerHeartbeat | None = None
        self.blocked = BlockedReads()

    @classmethod
    async def connect(cls, url: str, run: str, cfg: RedisConfig, worker: str) -> "Bus":
        """Connect to ``url`` (checked with PING) as consumer ``worker`` of run ``run``; the password comes from
        ``cfg.password_var`` when set (else from the URL)."""
        retry = Retry(ExponentialBackoff(cap=RECONNECT_MAX_S, base=RECONNECT_BASE_S),
                      retries=reconnect_tries(cfg.reconnect_timeout_s))
        client = async_client(url, decode_responses=False, retry=retry, password=redis_password(cfg),
                                         retry_on_error=[RedisConnectionError, RedisTimeoutError])
        pool = client.connection_pool
        pool.connection_class = fast_packing(pool.connection_class)
        try:
            await client.ping()
        except Exception as e:
            await client.aclose()
            raise RlbusError(f"cannot reach Redis at {redact(url)}: {e}; start one with `rlbus redis` or fix "
                             "redis.url (and redis.password_var)") from e
        return cls(client, run, cfg, worker)

    def start_heartbeat(self) -> None:
        """Renew this worker's heartbeat in ``workers`` (:mod:`bus.liveness`) until :meth:`close`."""
        self._heartbeat = WorkerHeartbeat(self.redis, self.keys.workers(), self.worker, self.cfg.heartbeat_s,
                                          self.log)
        self._heartbeat.start()

    def wake_blocked_reads(self) -> None:
        """End the reads blocked now with no entries (a stopping worker: :mod:`bus.wakeup`)."""
        self.blocked.wake()

    async def close(self) -> None:
        if self._heartbeat is not None:
            await self._heartbeat.stop()
        await close_async_client(self.redis)

    # Publishing.

    def _maxlen(self, stream: str) -> int | None:
        """MAXLEN of a fan-out stream; None for a consumer-group stream (trimmed by :meth:`trim_consumed`)."""
        if self.keys.is_group_stream(stream):
            return None
        if stream in (self.keys.policy(), self.keys.weights()):
            return min(self.cfg.maxlen, self.cfg.events_maxlen)
        return self.cfg.maxlen

    def _xadd(self, stream: str) -> tuple:
        """The XADD arguments before the fields: the stream, its MAXLEN (``~``) when it has one, the id ``*``."""
        maxlen = self._maxlen(stream)
        return ("XADD", stream, "*") if maxlen is None else ("XADD", stream, "MAXLEN", "~", maxlen, "*")

    async def publish(self, stream: str, message: Message) -> str:
        """XADD one message (fan-out streams: ``MAXLEN ~ redis.maxlen``); returns its entry id."""
        return as_str(await self.redis.execute_command(*self._xadd(stream), message.entry_args()))

    async def publish_many(self, stream: str, messages: list[Message]) -> list[str]:
        """XADD several messages in one pipeline round trip; returns their entry ids."""
        xadd = self._xadd(stream)
        pipe = self.redis.pipeline(transaction=False)
        for message in messages:
            pipe.execute_command(*xadd, message.entry_args())
        return [as_str(i) for i in await pipe.execute()]

    # Consumer groups.

    async def ensure_group(self, stream: str, group: str, start_id: str = "0") -> None:
        """Create ``group`` on ``stream`` (and the stream); a group that exists already is left alone."""
        try:
            await self.redis.xgroup_create(stream, group, id=start_id, mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def read_group(
        self, streams: list[str], group: str, count: int = 16, block_ms: int | None = None, *, skip: Skip = None
    ) -> list[Entry]:
        """XREADGROUP ``>`` over ``streams`` (groups are created at ``0`` when missing).

        Entries that fail to decode are dead-lettered (and acked) and left out of the result; so are, acked
        without being decoded, the entries whose raw fields ``skip`` returns True for (a reader that takes only
        some of a stream, such as eval's, tells them by a header field).
        """
        query = {s: ">" for s in streams}
        try:
            reply = await self.blocked.read(
                self.redis.xreadgroup(group, self.worker, query, count=count, block=block_ms), block_ms)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            for stream in streams:
                await self.ensure_group(stream, group)
            reply = await self.blocked.read(
                self.redis.xreadgroup(group, self.worker, query, count=count, block=block_ms), block_ms)
        entries: list[Entry] = []
        for stream, items in reply or []:
            entries += await self._decode_all(as_str(stream), group, items, {}, skip)
        return entries

    async def _decode_all(
        self, stream: str, group: str, items: list, deliveries: dict[str, int], skip: Skip
    ) -> list[Entry]:
        entries, skipped = [], []
        max_bytes = self.cfg.max_entry_bytes
        for raw_id, fields in items:
            entry_id = raw_id.decode() if type(raw_id) is bytes else as_str(raw_id)
            if fields is None or (skip is not None and skip(fields)):  # None: deleted (trimmed) while pending
                skipped.append(entry_id)
                continue
            count = deliveries.get(entry_id, 1) if deliveries else 1
            oversize = oversize_reason(fields, max_bytes)
            if oversize is not None:
                await self._dead_letter(stream, entry_id, cut(fields), oversize, group, count)
                continue
            try:
                message = decode(fields)
            except DecodeError as e:
                await self._dead_letter(stream, entry_id, fields, f"decode: {e}", group, count)
                continue
            entries.append(Entry(stream, entry_id, fields, message, count))
        await self.ack(stream, group, skipped)
        return entries

    async def reclaim(
        self,
        stream: str,
        group: str,
        count: int = 16,
        *,
        on_dead: Callable[[Entry, CommandRecorder], None] | None = None,
    ) -> list[Entry]:
        """Claim up to ``count`` entries idle ≥ ``claim_idle_ms`` (their consumer presumed dead).

        An entry whose delivery count now exceeds ``max_deliveries`` (it was processed that many
        times without an ack) is dead-lettered and acked instead of returned; ``on_dead(entry, pipe)``
        adds commands to that dead-letter commit (e.g. releasing the entry's in-flight count).
        """
        claimed: list = []
        cursor: bytes | str = "0-0"
        while len(claimed) < count:
            try:
                reply = await self.redis.xautoclaim(
                    stream, group, self.worker, self.cfg.claim_idle_ms, start_id=cursor, count=count - len(claimed)
                )
            except ResponseError as e:
                if "NOGROUP" in str(e):
                    return []
                raise
            cursor, items = reply[0], reply[1]
            claimed += items
            if as_str(cursor) == "0-0":
                break
        return await self._redelivered(stream, group, claimed, on_dead, None)

    async def read_pending(
        self,
        stream: str,
        group: str,
        after: str = "0",
        count: int = 64,
        *,
        on_dead: Callable[[Entry, CommandRecorder], None] | None = None,
        skip: Skip = None,
    ) -> tuple[list[Entry], str | None]:
        """This consumer's own pending entries after ``after`` (a restarted worker's replay), through the same
        delivery-count check as :meth:`reclaim` (and ``skip`` as in :meth:`read_group`). Returns the entries and
        the id to continue after (None: done)."""
        rows = await self.redis.xreadgroup(group, self.worker, {stream: after}, count=count)
        items = rows[0][1] if rows else []
        if not items:
            return [], None
        return await self._redelivered(stream, group, items, on_dead, skip), as_str(items[-1][0])

    async def _redelivered(
        self, stream: str, group: str, items: list, on_dead: Callable[[Entry, CommandRecorder], None] | None,
        skip: Skip,
    ) -> list[Entry]:
        """Decode entries delivered again; one delivered more than ``max_deliveries`` times goes to ``dead``."""
        if not items:
            return []
        deliveries = await self._delivery_counts(stream, group, [as_str(i) for i, f in items if f is not None])
        entries = []
        for entry in await self._decode_all(stream, group, items, deliveries, skip):
            if entry.deliveries > self.cfg.max_deliveries:
                reason = f"delivered {entry.deliveries} times (> redis.max_deliveries={self.cfg.max_deliveries})"
                extra = (lambda pipe, entry=entry: on_dead(entry, pipe)) if on_dead is not None else None
                await self.dead_letter(entry, reason=reason, group=group, extra=extra)
            else:
                entries.append(entry)
        return entries

    async def _delivery_counts(self, stream: str, group: str, ids: list[str]) -> dict[str, int]:
        pipe = self.redis.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xpending_range(stream, group, min=entry_id, max=entry_id, count=1)
        counts = {}
        for rows in await pipe.execute():
            for row in rows:
                counts[as_str(row["message_id"])] = int(row["times_delivered"])
        return counts

    async def ack(self, stream: str, group: str, ids: list[str]) -> None:
        if ids:
            await self.redis.xack(stream, group, *ids)

    async def dead_letter(
        self,
        entry: Entry,
        *,
        reason: str,
        group: str | None = None,
        extra: Callable[[CommandRecorder], None] | None = None,
    ) -> str | None:
        """Publish a DeadLetter (reason + original fields) of ``entry`` to ``dead`` and, with ``group``, ack the entry;
        ``extra(commands)`` joins the same commit. Returns the dead letter's id (None: the entry is another
        consumer's now, nothing was written)."""
        return await self._dead_letter(entry.stream, entry.id, entry.fields, reason, group, entry.deliveries, extra)

    async def _dead_letter(
        self,
        stream: str,
        entry_id: str,
        fields: dict,
        reason: str,
        group: str | None,
        deliveries: int,
        extra: Callable[[CommandRecorder], None] | None = None,
    ) -> str | None:
        """:meth:`dead_letter` of an entry in its raw form (one that did not decode has no :class:`Entry`)."""
        letter = DeadLetter(
            stream=stream,
            entry_id=entry_id,
            reason=reason,
            worker=self.worker,
            deliveries=deliveries or 1,
            fields={as_str(k): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()},
        )
        acks = [(stream, group, entry_id)] if group is not None else []
        try:
            ids = await self.commit(acks, [(self.keys.dead(), letter)], extra=extra)
        except NotOwned:
            self.log.warning("dead_letter_skipped", stream=stream, entry_id=entry_id, reason=reason,
                             hint="another consumer reclaimed the entry; it is theirs to finish")
            return None
        self.log.warning("entry_dead_lettered", stream=stream, entry_id=entry_id, reason=reason)
        return ids[0]

    # Atomic commit.

    async def commit(
        self,
        acks: list[tuple[str, str, str]],
        outputs: list[tuple[str, Message]],
        *,
        extra: Callable[[CommandRecorder], None] | None = None,
        guard: tuple[str, str, str | None] | None = None,
    ) -> list[str]:
        """Atomically: XACK each ``(stream, group, id)``, XADD each ``(stream, message)``, then ``extra(commands)``.

        Written only while every acked entry is still pending for this consumer, else :class:`NotOwned`
        (another consumer reclaimed it, or a retry of a commit that went through). ``guard=(hash_key, field,
        expected)``: only while HGET equals ``expected`` (None = field absent), else :class:`CommitConflict`.
        Both checks run inside Redis in the same script as the writes; on either, nothing is written.
        Returns the ids of the outputs. The commit runs to its end even if the caller is cancelled, and once: a
        re-send by redis-py after a lost reply returns the first run's ids.
        """
        encoded = [(stream, message.entry_args()) for stream, message in outputs]
        record = (self.keys.commit(uuid.uuid4().hex), record_ttl_ms(self.cfg.reconnect_timeout_s))
        args = commit_args(record, self.worker, acks, encoded, self._maxlen, extra, guard)
        return await asyncio.shield(self._commit(args.keys, args.argv, guard))

    async def _commit(self, keys: list[str], argv: list, guard) -> list[str]:
        if self.cfg.wait_replicas:  # WAIT counts the writes of its own connection: send both on one
            pipe = self.redis.pipeline(transaction=False)
            await self._commit_script(keys=keys, args=argv, client=pipe)
            pipe.wait(self.cfg.wait_replicas, self.cfg.wait_timeout_ms)
            reply, replicas = await pipe.execute()
        else:
            reply, replicas = await self._commit_script(keys=keys, args=argv), None
        status = as_str(reply[0])
        if status == "not_owned":
            raise NotOwned(f"{as_str(reply[1])} entry {as_str(reply[2])} is no longer pending for {self.worker} "
                           f"(another consumer reclaimed it, or an earlier commit acked it); nothing was written")
        if status == "conflict":
            raise CommitConflict(f"{as_str(reply[1])} {as_str(reply[2])} is {reply[3]!r}, expected {guard[2]!r}")
        if replicas is not None:
            warn_if_lagging(self.log, self.cfg, replicas)
        return [as_str(i) for i in reply[1:]]

    # What a stream holds.

    async def length(self, stream: str) -> int:
        """XLEN: entries in ``stream`` (0 when there is none)."""
        return int(await self.redis.xlen(stream))

    async def groups(self, stream: str) -> list[dict]:
        """XINFO GROUPS of ``stream``: each group's ``name``, ``pending``, ``lag``, … ([] when there is no stream)."""
        try:
            return await self.redis.xinfo_groups(stream)
        except ResponseError:  # no such stream
            return []

    # The run's state hash.

    async def state_get(self, field: str) -> str | None:
        value = await self.redis.hget(self.keys.state(), field)
        return None if value is None else as_str(value)

    async def state_set(self, **fields: Any) -> None:
        if fields:
            await self.redis.hset(self.keys.state(), mapping={k: str(v) for k, v in fields.items()})

    async def state_incr(self, field: str, by: int = 1) -> int:
        return int(await self.redis.hincrby(self.keys.state(), field, by))
