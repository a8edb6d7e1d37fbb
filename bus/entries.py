"""A delivered stream entry, and the size and order checks every read applies to one.

An entry larger than ``redis.max_entry_bytes`` is never decoded: the bus dead-letters it (keeping
``KEPT_BYTES`` of each field) or, on a fan-out stream, logs and skips it.
"""

from dataclasses import dataclass

from bus.codec import Message

KEPT_BYTES = 1024
"""How much of each field of an oversized entry its dead letter keeps."""


@dataclass(slots=True)
class Entry:
    """One delivered stream entry."""

    stream: str
    id: str
    fields: dict[bytes, bytes]
    message: Message
    deliveries: int = 1


def entry_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id as a sortable ``(milliseconds, sequence)``."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def entry_size(fields: dict[bytes, bytes]) -> int:
    """Bytes of an entry's field names and values."""
    return sum(map(len, fields)) + sum(map(len, fields.values()))


def oversize_reason(fields: dict[bytes, bytes], max_bytes: int) -> str | None:
    """Why an entry is too big to decode (None: it is not)."""
    size = entry_size(fields)
    return f"entry of {size} bytes exceeds redis.max_entry_bytes={max_bytes}" if size > max_bytes else None


def cut(fields: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """The first ``KEPT_BYTES`` of each field: what the dead letter of an oversized entry keeps."""
    return {k: v[:KEPT_BYTES] for k, v in fields.items()}
