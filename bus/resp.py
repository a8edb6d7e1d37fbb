"""RESP helpers: faster command packing for redis-py's asyncio connections, and reply text.

redis-py packs every argument through a chain of isinstance checks and re-joins the whole
buffer per argument: ~16 µs for one 26-argument XADD, about half of a pipelined XADD's cost.
:func:`fast_packing` derives a connection class whose ``pack_command`` builds the same bytes
(tests compare them with redis-py's own) in ~4 µs. Everything else — pipelines, MULTI/EXEC,
WATCH, retries, reply parsing — stays redis-py's.
"""

from functools import cache

from redis.asyncio.connection import AbstractConnection


class FastPackMixin:
    """Mixin over a redis-py asyncio connection class: same wire bytes as ``pack_command``, fewer copies."""

    def pack_command(self, *args):
        first = args[0]
        if isinstance(first, str):
            args = (*first.encode().split(), *args[1:])
        elif b" " in first:
            args = (*first.split(), *args[1:])
        encoder = self.encoder
        encoding, errors = encoder.encoding, encoder.encoding_errors
        cutoff = self._buffer_cutoff
        output: list = []
        pieces: list = [b"*%d\r\n" % len(args)]
        for arg in args:
            kind = type(arg)
            if kind is str:
                arg = arg.encode(encoding, errors)
            elif kind is not bytes:
                arg = encoder.encode(arg)
            size = len(arg)
            if size > cutoff or isinstance(arg, memoryview):
                # Large values travel as their own chunk (no copy), like redis-py does.
                pieces.append(b"$%d\r\n" % size)
                output.append(b"".join(pieces))
                output.append(arg)
                pieces = [b"\r\n"]
            else:
                pieces += (b"$%d\r\n" % size, arg, b"\r\n")
        output.append(b"".join(pieces))
        return output


def as_str(value: bytes | str | int) -> str:
    """A Redis reply value as text: bytes decoded as UTF-8 (undecodable bytes become U+FFFD), others via str()."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value if isinstance(value, str) else str(value)


@cache
def fast_packing(connection_class: type[AbstractConnection]) -> type[AbstractConnection]:
    """``connection_class`` with :class:`FastPackMixin`'s ``pack_command``."""
    return type(f"FastPack{connection_class.__name__}", (FastPackMixin, connection_class), {})
