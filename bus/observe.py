"""Read-only views of a run for monitoring (``rlbus exporter``, ``rlbus inspect --latency``), over a sync client.

Nothing here writes or joins a consumer group: the groups' figures come from ``XINFO``/``XPENDING``, and the
streams are followed with plain ``XREAD`` from a remembered id, so watching a run never changes what it does.
Times are Redis's own clock (``TIME``) and entry ids (milliseconds), so they agree across hosts.
"""

from dataclasses import dataclass, field

import redis

from bus.keys import GROUP_STREAMS, Keys
from bus.resp import as_str

ACTIVE_CONSUMER_MS = 60_000
"""A consumer that read or acked within this long counts as alive (``XINFO CONSUMERS`` idle time)."""

PENDING_SAMPLE = 100
"""The oldest pending entries whose delivery counts are read per group (the highest of them is reported)."""


@dataclass
class GroupView:
    """One consumer group of one stream."""

    name: str
    lag: int | None
    """Entries not yet delivered to the group (None when Redis cannot tell, e.g. after a trim)."""
    pending: int
    """Delivered, not yet acked."""
    entries_read: int | None
    """Entries the group has read over the stream's life (Redis ≥ 7; None before)."""
    consumers: int
    """Consumers that read or acked within :data:`ACTIVE_CONSUMER_MS`."""
    oldest_pending_age_s: float
    """Age (by entry id) of the oldest pending entry; 0 when none is pending."""
    max_deliveries: int
    """Highest delivery count among the :data:`PENDING_SAMPLE` oldest pending entries (0 when none)."""


@dataclass
class StreamView:
    key: str
    family: str
    """``tasks``, ``rollouts``, ``filtered``, …"""
    suffix: str
    """The env (or step) the stream belongs to; '' for run-wide streams."""
    length: int
    groups: list[GroupView] = field(default_factory=list)


def now_ms(client: redis.Redis) -> int:
    """Redis's clock in milliseconds."""
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def id_ms(entry_id: str | bytes) -> int:
    """The milliseconds part of a stream entry id."""
    return int(as_str(entry_id).split("-", 1)[0])


def group_streams(client: redis.Redis, keys: Keys) -> list[str]:
    """Every consumer-group stream of the run (``tasks:*``, ``rollouts:*``, ``filtered:*``), sorted."""
    found = set()
    for family in GROUP_STREAMS:
        found.update(as_str(k) for k in client.scan_iter(match=f"{keys.prefix}{family}:*", count=1000, _type="stream"))
    return sorted(found)


def stream_view(client: redis.Redis, keys: Keys, key: str, at_ms: int) -> StreamView | None:
    """Length and every group of ``key`` (None when the stream is gone)."""
    try:
        length = client.xlen(key)
        groups = client.xinfo_groups(key)
    except redis.ResponseError:  # deleted between the scan and the read
        return None
    view = StreamView(key, keys.family(key), keys.suffix(key), int(length))
    for info in groups:
        view.groups.append(_group_view(client, key, info, at_ms))
    return view


def _group_view(client: redis.Redis, key: str, info: dict, at_ms: int) -> GroupView:
    name = as_str(info["name"])
    consumers = sum(1 for c in client.xinfo_consumers(key, name) if c["idle"] < ACTIVE_CONSUMER_MS)
    oldest_age_s, max_deliveries = 0.0, 0
    if info["pending"]:
        pending = client.xpending_range(key, name, min="-", max="+", count=PENDING_SAMPLE)
        if pending:
            oldest_age_s = max(0.0, (at_ms - id_ms(pending[0]["message_id"])) / 1000)
            max_deliveries = max(int(p["times_delivered"]) for p in pending)
    read = info.get("entries-read")
    return GroupView(name, info.get("lag"), int(info["pending"]), None if read is None else int(read), consumers,
                     oldest_age_s, max_deliveries)


def read_after(client: redis.Redis, positions: dict[str, str], count: int = 500,
               block_ms: int | None = None) -> list[tuple[str, str, dict]]:
    """New entries of each stream after its remembered id, oldest first per stream: ``(stream, id, fields)``;
    advances ``positions`` (stream → last id read; ``"0"`` reads from the start). The first read waits up to
    ``block_ms`` for an entry (None: not at all); then it reads until every stream is drained."""
    out: list[tuple[str, str, dict]] = []
    todo = dict(positions)
    while todo:
        replies = client.xread(todo, count=count, block=block_ms) or []
        todo, block_ms = {}, None
        for stream, entries in replies:
            stream = as_str(stream)
            for entry_id, fields in entries:
                out.append((stream, as_str(entry_id), fields))
            if entries:
                positions[stream] = as_str(entries[-1][0])
            if len(entries) >= count:
                todo[stream] = positions[stream]
    return out


def stream_length(client: redis.Redis, key: str) -> int:
    """Entries in ``key`` (0 when it does not exist)."""
    return int(client.xlen(key))


def read_all(client: redis.Redis, key: str) -> list[tuple[str, dict]]:
    """Every entry of ``key`` (a step's micro-batches): ``(id, fields)``, oldest first."""
    return [(as_str(i), f) for i, f in client.xrange(key)]


def heartbeat_ages(client: redis.Redis, key: str, at_ms: int) -> dict[str, float]:
    """Member → seconds since its last beat, of a heartbeat sorted set (``workers`` or ``servers``)."""
    return {as_str(m): max(0.0, (at_ms - score) / 1000) for m, score in client.zrange(key, 0, -1, withscores=True)}


def state_fields(client: redis.Redis, keys: Keys) -> dict[str, str]:
    """The run's state hash, as text."""
    return {as_str(k): as_str(v) for k, v in client.hgetall(keys.state()).items()}
