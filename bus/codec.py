"""The codec of every stream message: the :class:`Message` base, its stream entry (``to_fields`` /
``entry_args``) and its decoding (``from_fields`` / :func:`decode_as`), and the checks the schemas share.

A stream entry is a flat map: readable header fields first (``kind``, ``v`` and a few values a
person reads with ``redis-cli XRANGE``), then ``data``: the whole message as msgpack, arrays as
raw bytes. Decoding reads only ``kind``, ``v`` and ``data``; the header is for people. The bus sends the
same fields as ``entry_args()``, already in RESP form.

Decoding validates everything before a worker sees it: msgspec checks each field's type and rejects unknown
fields as it reads the bytes (in C, straight into the struct; an array field must be one ``bin``), and each struct's
``__post_init__`` checks the rest (an array's bytes against its item size, bounds, lengths that must agree, finite
values). The same ``__post_init__`` runs when a worker builds a message, so a bad one fails where it is made; types
are checked only on decode (a struct built in process takes its fields as given). The schemas themselves, and
:func:`bus.messages.decode` (an entry of any kind), live in :mod:`bus.messages`.
"""

import functools
import math
import operator
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import msgspec
import numpy as np

from bus.arrays import pack_message, triple_bytes, unpackb
from bus.errors import DecodeError
from bus.resp import RespArgs, as_str, bulk


class Struct(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, gc=False):
    """Base of every message and of the structs inside them: keyword fields, unknown fields rejected on decode, not
    tracked by the garbage collector (a message holds no reference cycle)."""

    def replace(self, **changes: Any) -> typing.Self:
        """A copy with ``changes``, checked like a new one (its ``__post_init__`` runs)."""
        return msgspec.structs.replace(self, **changes)


class Message(Struct, kw_only=True):
    """Base of every stream message."""

    KIND: ClassVar[str]
    V: ClassVar[int] = 1
    HEADER: ClassVar[tuple[str, ...]] = ()
    TRIPLES_BEFORE: ClassVar[int] = 0
    """Schema versions below this held their arrays as wire triples (:func:`bus.arrays.triple_bytes`); 0: none did."""

    def to_fields(self) -> dict[str, bytes | str]:
        """The stream entry: readable header fields, then ``data`` (msgpack)."""
        version, payload = self._written_as()
        fields: dict[str, bytes | str] = {"kind": self.KIND, "v": str(version)}
        for name, value in zip(self.HEADER, _header_getter(type(self))(self), strict=True):
            if value is not None:
                fields[name] = value if type(value) is str else _header_text(value)
        fields["data"] = pack_message(payload)
        return fields

    def entry_args(self) -> RespArgs:
        """The fields and values of :meth:`to_fields` as XADD arguments already in RESP form, what the bus sends: the
        field names and the ``kind`` and ``v`` values are packed once per kind, so only the header values and ``data``
        are packed per message."""
        version, payload = self._written_as()
        head, names = _resp_layout(type(self), version)
        pieces = [head]
        count = 4
        for name, value in zip(names, _header_getter(type(self))(self), strict=True):
            if value is not None:
                text = value if type(value) is str else _header_text(value)
                pieces.append(f"{name}${len(text) if text.isascii() else len(text.encode())}\r\n{text}\r\n")
                count += 2
        data = pack_message(payload)
        pieces.append(f"$4\r\ndata\r\n${len(data)}\r\n")
        return RespArgs(count + 2, "".join(pieces).encode(), data)

    def _written_as(self) -> tuple[int, Any]:
        """The schema version this message is written as, and what its ``data`` holds: the message itself, or its
        fields as an older version has them (which older readers still take)."""
        return self.V, self

    def _without(self, *names: str) -> dict[str, Any]:
        """This message's fields but ``names``: what an older version of it holds."""
        return {name: getattr(self, name) for name in self.__struct_fields__ if name not in names}

    @classmethod
    def _bytes_from_triples(cls, payload: dict[str, Any]) -> None:
        """Put bare bytes in place of the wire triples in an older version's decoded ``payload``."""

    @classmethod
    def from_fields(cls, fields: Mapping[Any, Any]) -> "Message":
        """Decode a stream entry of this kind; any problem raises DecodeError."""
        kind = entry_kind(fields)
        if kind != cls.KIND:
            raise DecodeError(f"expected a {cls.KIND!r} entry, got kind {kind!r}")
        return decode_as(cls, fields)


_MAP_HEADS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])
"""First byte of a msgpack map (fixmap, map 16, map 32)."""


def entry_kind(fields: Mapping[Any, Any]) -> str:
    """The ``kind`` field of a stream entry; DecodeError when it has none."""
    return _text(_get(fields, b"kind"))


def entry_data(fields: Mapping[Any, Any]) -> Any:
    """The ``data`` field of a stream entry (msgpack); DecodeError when it has none."""
    return _get(fields, b"data")


def entry_version(cls: type[Message], fields: Mapping[Any, Any]) -> int:
    """The schema version of a stream entry of kind ``cls``; DecodeError when it is none or newer than this reader's."""
    raw_v = _get(fields, b"v")
    try:
        version = int(raw_v)
    except (TypeError, ValueError) as e:
        raise DecodeError(f"schema version v={_text(raw_v)!r} is not an integer") from e
    if version > cls.V:
        raise DecodeError(
            f"{cls.KIND} schema v={version} is newer than this reader's v={cls.V}; upgrade rlbus on this worker"
        )
    return version


def decode_as(cls: type[Message], fields: Mapping[Any, Any]) -> Message:
    """Decode a stream entry as a ``cls`` message (its kind already checked); any problem raises DecodeError."""
    version = entry_version(cls, fields)
    data = entry_data(fields)
    if version < cls.TRIPLES_BEFORE:
        return _decode_triples(cls, version, data)
    return decode_data(cls, version, data)


def decode_data(cls: type, version: int, data: bytes) -> Any:
    """The ``data`` field of a ``cls`` entry decoded into ``cls`` (a message, or a struct with some of its fields:
    the others are skipped unread); any problem raises DecodeError."""
    try:
        return typed_decoder(cls).decode(data)
    except msgspec.ValidationError as e:
        kind = _kind_name(cls)
        if data[:1] and data[0] not in _MAP_HEADS:
            raise DecodeError(f"{kind} data: expected a map ({e})") from e
        raise DecodeError(f"{kind} v{version} does not validate: {e}") from e
    except msgspec.DecodeError as e:
        raise DecodeError(f"not valid msgpack: {e}") from e
    except (TypeError, ValueError, OverflowError) as e:  # whatever the bytes were
        raise DecodeError(f"{_kind_name(cls)} v{version} does not validate: {e}") from e


def _kind_name(cls: type) -> str:
    return getattr(cls, "KIND", cls.__name__)


def _decode_triples(cls: type[Message], version: int, data: bytes) -> Message:
    """Decode an entry of an older version whose arrays are wire triples (replayed archives, older writers)."""
    payload = unpackb(data)
    if not isinstance(payload, dict):
        raise DecodeError(f"{cls.KIND} data: expected a map, got {type(payload).__name__}")
    try:
        cls._bytes_from_triples(payload)
        return msgspec.convert(payload, cls)
    except (msgspec.ValidationError, TypeError, ValueError, OverflowError) as e:
        raise DecodeError(f"{cls.KIND} v{version} does not validate: {e}") from e


def triples_to_bytes(payload: Any, arrays: tuple[tuple[str, np.dtype], ...]) -> None:
    """Each of ``arrays`` (name, dtype) present in the map ``payload`` from its wire triple to its bytes."""
    if not isinstance(payload, dict):
        return  # not a map: msgspec.convert says so
    for name, dtype in arrays:
        value = payload.get(name)
        if value is not None:
            payload[name] = triple_bytes(value, dtype, name)


def _get(fields: Mapping[Any, Any], name: bytes) -> Any:
    value = fields.get(name)
    if value is None:
        value = fields.get(name.decode())
    if value is None:
        raise DecodeError(f"entry has no {name.decode()!r} field (fields: {sorted(as_str(k) for k in fields)})")
    return value


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError as e:
            raise DecodeError(f"header value {value[:32]!r} is not UTF-8") from e
    return str(value)


@functools.cache
def _resp_layout(cls: type[Message], version: int) -> tuple[str, tuple[str, ...]]:
    """The ``kind`` and ``v`` fields of a ``cls`` entry of schema ``version`` in RESP form, and each header field's
    name (text: a header is built as text and encoded once)."""
    head = b"".join(map(bulk, (b"kind", cls.KIND.encode(), b"v", str(version).encode())))
    return head.decode(), tuple(bulk(name.encode()).decode() for name in cls.HEADER)


@functools.cache
def _header_getter(cls: type[Message]) -> Callable[[Message], tuple]:
    """The values of ``cls.HEADER`` as a tuple, in one call."""
    if len(cls.HEADER) > 1:
        return operator.attrgetter(*cls.HEADER)
    return lambda message: tuple(getattr(message, name) for name in cls.HEADER)


def _header_text(value: Any) -> str:
    kind = type(value)
    if kind is str:
        return value
    if kind is float:
        return f"{value:.6g}"
    if kind is bool:
        return "1" if value else "0"
    return str(value)


def check_finite_value(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def check_at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


@functools.cache
def typed_decoder(cls: type) -> msgspec.msgpack.Decoder:
    """The typed decoder of message kind ``cls`` (or of a struct of some of its fields): the bytes go straight into the
    struct, every field checked as it is read."""
    return msgspec.msgpack.Decoder(cls)
