"""Async request/reply over ZeroMQ: a ROUTER server and a DEALER client with msgpack frames.

Frames on the wire (after ZeroMQ's routing identity on the server side):

- request: ``[request_id, method, packb(kwargs)]``
- reply:   ``[request_id, b"ok", packb(result)]`` or ``[request_id, b"err", b"<Type>: <message>"]``

Request ids let one client carry many concurrent calls; each call waits for its own reply up to
its timeout. A handler that raises sends the error back; the caller raises ``RpcError`` with the
handler's error type and message. No reply in time (peer gone, never started, hung) raises
``RpcTimeoutError`` naming the address and the method. Sockets use LINGER 0, so closing never blocks.
"""

import asyncio
import inspect
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from bus.arrays import packb, unpackb
from bus.errors import DecodeError, RpcError, RpcTimeoutError

Handler = Callable[..., Awaitable[Any] | Any]

_OK = b"ok"
_ERR = b"err"


def _context() -> zmq.asyncio.Context:
    return zmq.asyncio.Context.instance()


class RpcServer:
    """Serves ``handlers`` (method name → sync or async function taking keyword arguments) on ``address``.

    ``await serve()`` binds and answers requests until ``await close()``; each request runs in its own
    task, so a slow async handler does not hold up the others. ``address`` may use port 0
    (``tcp://127.0.0.1:0``); after :meth:`bind` it holds the real endpoint.
    """

    def __init__(self, address: str, handlers: dict[str, Handler]):
        self.address = address
        self.handlers = dict(handlers)
        self._socket: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task | None = None
        self._requests: set[asyncio.Task] = set()
        self._closing = False

    def bind(self) -> str:
        """Bind the ROUTER socket (idempotent); returns the bound endpoint."""
        if self._socket is None:
            socket = _context().socket(zmq.ROUTER)
            socket.setsockopt(zmq.LINGER, 0)
            try:
                socket.bind(self.address)
            except zmq.ZMQError as e:
                socket.close(linger=0)
                raise RpcError(f"cannot bind RPC server to {self.address}: {e}; pick a free address") from e
            self.address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
            self._socket = socket
        return self.address

    async def serve(self) -> None:
        """Answer requests until :meth:`close` is called."""
        if self._closing:
            return
        self.bind()
        self._receiver = asyncio.ensure_future(self._receive_loop())
        try:
            await self._receiver
        except asyncio.CancelledError:
            if not self._closing:
                raise

    async def close(self) -> None:
        """Stop serving, cancel in-flight requests and close the socket."""
        self._closing = True
        if self._receiver is not None:
            self._receiver.cancel()
        for task in list(self._requests):
            task.cancel()
        if self._requests:
            await asyncio.gather(*self._requests, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    async def _receive_loop(self) -> None:
        assert self._socket is not None
        while True:
            frames = await self._socket.recv_multipart()
            if len(frames) != 4:
                continue  # not an rlbus RPC client; nothing to answer
            task = asyncio.ensure_future(self._answer(*frames))
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)

    async def _answer(self, identity: bytes, request_id: bytes, method: bytes, payload: bytes) -> None:
        try:
            result = await self._dispatch(method.decode("utf-8", "replace"), payload)
            reply = [identity, request_id, _OK, packb(result)]
        except asyncio.CancelledError:
            raise
        except Exception as e:
            reply = [identity, request_id, _ERR, f"{type(e).__name__}: {e}".encode()]
        if self._socket is not None:
            await self._socket.send_multipart(reply)

    async def _dispatch(self, method: str, payload: bytes) -> Any:
        handler = self.handlers.get(method)
        if handler is None:
            raise RpcError(f"unknown method {method!r}; this server answers {sorted(self.handlers)}")
        kwargs = unpackb(payload)
        if not isinstance(kwargs, dict):
            raise DecodeError(f"arguments of {method!r} must be a map, got {type(kwargs).__name__}")
        result = handler(**kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result


class RpcClient:
    """Calls methods of the :class:`RpcServer` at ``address``; safe for concurrent calls in one event loop."""

    def __init__(self, address: str, timeout_s: float = 10.0):
        self.address = address
        self.timeout_s = timeout_s
        self._socket: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task | None = None
        self._pending: dict[bytes, asyncio.Future] = {}
        self._ids = itertools.count(1)

    async def call(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Call ``method(**kwargs)`` remotely and return its result.

        Raises RpcError when the handler raised, RpcTimeoutError when no reply came within
        ``timeout_s`` (default: the client's).
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        socket = self._connect()
        request_id = next(self._ids).to_bytes(8, "little")
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            async with asyncio.timeout(timeout):
                await socket.send_multipart([request_id, method.encode(), packb(kwargs)])
                status, payload = await future
        except TimeoutError as e:
            raise RpcTimeoutError(
                f"no reply from {self.address} to {method!r} within {timeout:g}s; "
                "is the server running at that address?"
            ) from e
        finally:
            self._pending.pop(request_id, None)
        if status == _ERR:
            raise RpcError(payload.decode("utf-8", "replace"))
        return unpackb(payload)

    async def close(self) -> None:
        """Close the socket; calls still waiting fail with RpcError."""
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
            self._receiver = None
        for future in self._pending.values():
            if not future.done():
                future.set_exception(RpcError(f"RPC client for {self.address} was closed"))
        self._pending.clear()
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def _connect(self) -> zmq.asyncio.Socket:
        if self._socket is None:
            socket = _context().socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(self.address)
            self._socket = socket
            self._receiver = asyncio.ensure_future(self._receive_loop(socket))
        return self._socket

    async def _receive_loop(self, socket: zmq.asyncio.Socket) -> None:
        while True:
            frames = await socket.recv_multipart()
            if len(frames) != 3:
                continue
            future = self._pending.get(frames[0])
            if future is not None and not future.done():
                future.set_result((frames[1], frames[2]))

    async def __aenter__(self) -> "RpcClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
