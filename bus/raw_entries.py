"""A run's stream entries as they lie in Redis, for the operator tools (``rlbus inspect``, ``rlbus replay``) on a
synchronous client: a stream's groups and lag, its entries in ranges, and appending copies of entries.

Nothing here decodes, acks or dead-letters: a worker reads messages through :class:`bus.streams.Bus`. A tool that
shows or copies entries byte for byte reads them here.
"""

from collections.abc import Iterator
from typing import Any

import redis

from bus.entries import entry_order
from bus.resp import as_str

Fields = dict[bytes, bytes]
"""An entry's field map as Redis returns it."""


def stream_report(client: redis.Redis, key: str, now_ms: int) -> dict[str, Any]:
    """Length, first/last id and every consumer group (consumers, lag, pending, oldest pending age)."""
    info = client.xinfo_stream(key)
    report: dict[str, Any] = {
        "key": key,
        "length": info["length"],
        "first_id": as_str(info["first-entry"][0]) if info.get("first-entry") else None,
        "last_id": as_str(info["last-generated-id"]),
        "groups": [],
    }
    for group in client.xinfo_groups(key):
        report["groups"].append(_group_report(client, key, group, now_ms))
    return report


def _group_report(client: redis.Redis, key: str, group: dict, now_ms: int) -> dict[str, Any]:
    name = as_str(group["name"])
    consumers = [
        {"name": as_str(c["name"]), "pending": c["pending"], "idle_ms": c["idle"]}
        for c in client.xinfo_consumers(key, name)
    ]
    oldest_age_s = oldest_idle_ms = None
    first = client.xpending_range(key, name, min="-", max="+", count=1) if group["pending"] else []
    if first:  # (acked since XINFO GROUPS counted it: none)
        oldest_age_s = round((now_ms - entry_order(as_str(first[0]["message_id"]))[0]) / 1000, 3)
        oldest_idle_ms = first[0]["time_since_delivered"]
    return {
        "name": name,
        "consumers": consumers,
        "lag": group.get("lag"),
        "pending": group["pending"],
        "last_delivered_id": as_str(group["last-delivered-id"]),
        "oldest_pending_age_s": oldest_age_s,
        "oldest_pending_idle_ms": oldest_idle_ms,
    }


def newest_entries(client: redis.Redis, key: str, count: int) -> list[tuple[str, Fields]]:
    """The last ``count`` entries of ``key``, oldest first."""
    return [(as_str(raw_id), fields) for raw_id, fields in reversed(client.xrevrange(key, count=count))]


def entry_chunks(client: redis.Redis, key: str, low: str = "-", high: str = "+",
                 chunk: int = 500) -> Iterator[list[tuple[str, Fields]]]:
    """The entries of ``key`` with ids in [low, high], oldest first, ``chunk`` per XRANGE."""
    while True:
        rows = [(as_str(raw_id), fields) for raw_id, fields in client.xrange(key, min=low, max=high, count=chunk)]
        if rows:
            yield rows
        if len(rows) < chunk:
            return
        low = "(" + rows[-1][0]


def append_entries(client: redis.Redis, key: str, entries: list[dict[bytes | str, bytes | str]]) -> None:
    """XADD each field map of ``entries`` to ``key``, in order, in one pipeline (new ids, no MAXLEN)."""
    pipe = client.pipeline(transaction=False)
    for fields in entries:
        pipe.xadd(key, fields)
    pipe.execute()


def all_entries(client: redis.Redis, key: str, low: str = "-", high: str = "+") -> Iterator[tuple[str, Fields]]:
    """The entries of ``key`` with ids in [low, high], oldest first, one at a time (read in chunks)."""
    for rows in entry_chunks(client, key, low, high):
        yield from rows
