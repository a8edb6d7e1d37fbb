"""A TCP proxy on loopback in front of Redis that can lose the reply of a command, as a network that fails
between a command's arrival and its reply does: the server runs the command, the client never hears back, and
redis-py re-sends it on a new connection."""

import asyncio


class LossyProxy:
    """Forwards every connection to ``host:port``; after :meth:`drop_reply_of`, the next command whose bytes
    contain ``marker`` reaches the server, its reply is read and thrown away, and the client's connection closed."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.dropped = 0
        """Replies thrown away so far."""
        self._armed: list[bytes] = []
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()

    async def start(self) -> int:
        """Listen on a free loopback port; returns it."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    def drop_reply_of(self, marker: bytes) -> None:
        """Lose the reply of the next command containing ``marker`` (once)."""
        self._armed.append(marker)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for handler in list(self._handlers):
            handler.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._handlers.add(asyncio.current_task())
        server_reader, server_writer = await asyncio.open_connection(self.host, self.port)
        dropping = asyncio.Event()
        pumps = [asyncio.create_task(self._up(client_reader, server_writer, dropping)),
                 asyncio.create_task(self._down(server_reader, client_writer, dropping))]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # close(): end quietly, this connection is done
            pass
        for pump in pumps:
            pump.cancel()
        for writer in (client_writer, server_writer):
            writer.close()
        self._handlers.discard(asyncio.current_task())

    async def _up(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, dropping: asyncio.Event) -> None:
        while chunk := await reader.read(1 << 16):
            for marker in self._armed:
                if marker in chunk:
                    self._armed.remove(marker)
                    dropping.set()
                    break
            writer.write(chunk)
            await writer.drain()

    async def _down(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, dropping: asyncio.Event) -> None:
        while chunk := await reader.read(1 << 16):
            if dropping.is_set():  # the reply of the marked command: the client never sees it
                self.dropped += 1
                return
            writer.write(chunk)
            await writer.drain()
