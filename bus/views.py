"""Partial reads of stream messages, for readers that follow a stream without consuming it (the exporter's hop
latencies): a view names the fields it needs, and the others (a group's samples, a micro-batch's token arrays) are
skipped unread and unchecked. The stage that consumes the entry decodes it whole and dead-letters it if it is bad."""

from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from bus.arrays import INT32, Int32Array, as_array
from bus.codec import decode_as, decode_data, entry_data, entry_kind, entry_version
from bus.errors import DecodeError
from bus.messages import Message, MicroBatch, RolloutGroup


class GroupView(msgspec.Struct, kw_only=True, gc=False):
    """Of a :class:`~bus.messages.RolloutGroup`: its task, eval step and timings."""

    task_id: str
    eval_step: int | None = None
    timings: dict[str, float] = msgspec.field(default_factory=dict)


class BatchView(msgspec.Struct, kw_only=True, gc=False):
    """Of a :class:`~bus.messages.MicroBatch`: its step, and each packed sample's task and start policy version."""

    step: int
    policy_versions: Int32Array
    task_ids: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        self.policy_versions = as_array(self.policy_versions, INT32, "policy_versions")


VIEWS: dict[type, type[Message]] = {GroupView: RolloutGroup, BatchView: MicroBatch}
"""Each view and the message kind it reads."""

View = TypeVar("View", GroupView, BatchView)


def decode_view(view: type[View], fields: Mapping[Any, Any]) -> View:
    """A stream entry of the view's message kind read as ``view``; DecodeError when it is another kind, or what the
    view reads of it is bad. An entry of a schema older than the view's (arrays as triples) is decoded whole."""
    cls = VIEWS[view]
    kind = entry_kind(fields)
    if kind != cls.KIND:
        raise DecodeError(f"expected a {cls.KIND} entry, got {kind!r}")
    version = entry_version(cls, fields)
    if version < cls.TRIPLES_BEFORE:
        message = decode_as(cls, fields)
        return view(**{name: getattr(message, name) for name in view.__struct_fields__})
    return decode_data(view, version, entry_data(fields))
