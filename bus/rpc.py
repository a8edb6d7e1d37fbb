"""Async request/reply over ZeroMQ: a ROUTER server and a DEALER client with msgpack frames.

Frames on the wire (after ZeroMQ's routing identity on the server side):

- request: ``[request_id, method, packb(kwargs)]``
- reply:   ``[request_id, b"ok", packb(result)]`` or ``[request_id, b"err", b"<Type>: <message>"]``
- batch:   calls a client starts in the same event-loop tick travel as one message,
  ``[batch_id, b"rpc.batch", packb([[request_id, method, packb(kwargs)], …])]``; the server answers
  the calls that finish at once in one ``[batch_id, b"batch", packb([[request_id, status, payload], …])]``
  and each slower one with its own reply. A server that predates batches answers ``err`` to the
  batch id; the client then sends that batch's calls one by one, and every call after it.

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
_BATCH = b"rpc.batch"
"""The method name of a batch request (no handler may have it)."""
_BATCH_REPLY = b"batch"


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
            answer = self._answer_batch if frames[2] == _BATCH else self._answer
            task = asyncio.ensure_future(answer(*frames))
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)

    async def _answer(self, identity: bytes, request_id: bytes, method: bytes, payload: bytes) -> None:
        status, body = await self._reply(method, payload)
        await self._send([identity, request_id, status, body])

    async def _answer_batch(self, identity: bytes, batch_id: bytes, _method: bytes, payload: bytes) -> None:
        """One reply for the batch's calls that finish within one loop tick; the others answer on their own."""
        try:
            calls = _batch_items(unpackb(payload))
        except DecodeError as e:
            await self._send([identity, batch_id, _ERR, f"DecodeError: {e}".encode()])
            return
        replies = [(request_id, asyncio.ensure_future(self._reply(method, body))) for request_id, method, body in calls]
        try:
            if replies:
                await asyncio.wait([reply for _, reply in replies], timeout=0)
            done = [[request_id, *reply.result()] for request_id, reply in replies if reply.done()]
            late = [(request_id, reply) for request_id, reply in replies if not reply.done()]
            await self._send([identity, batch_id, _BATCH_REPLY, packb(done)])
            await asyncio.gather(*(self._answer_late(identity, request_id, reply) for request_id, reply in late))
        except asyncio.CancelledError:
            for _, reply in replies:
                reply.cancel()
            raise

    async def _answer_late(self, identity: bytes, request_id: bytes, reply: asyncio.Future) -> None:
        status, body = await reply
        await self._send([identity, request_id, status, body])

    async def _reply(self, method: bytes, payload: bytes) -> tuple[bytes, bytes]:
        """(status, body) of one call: the packed result, or the handler's error as ``Type: message``."""
        try:
            return _OK, packb(await self._dispatch(method.decode("utf-8", "replace"), payload))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            return _ERR, f"{type(e).__name__}: {e}".encode()

    async def _send(self, frames: list[bytes]) -> None:
        if self._socket is not None:
            await self._socket.send_multipart(frames)

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


def _batch_items(items: Any) -> list[tuple[bytes, bytes, bytes]]:
    """The ``[id, method-or-status, payload]`` triples of a batch message, checked (DecodeError if malformed)."""
    if not isinstance(items, list) or not all(
            isinstance(item, list) and len(item) == 3 and all(isinstance(part, bytes) for part in item)
            for item in items):
        raise DecodeError("a batch must be a list of [id, name, payload] byte triples")
    return [tuple(item) for item in items]


class RpcClient:
    """Calls methods of the :class:`RpcServer` at ``address``; safe for concurrent calls in one event loop."""

    def __init__(self, address: str, timeout_s: float = 10.0):
        self.address = address
        self.timeout_s = timeout_s
        self._socket: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task | None = None
        self._pending: dict[bytes, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._outbox: list[list[bytes]] = []
        """Requests started in this loop tick, sent together by :meth:`_flush`."""
        self._batches: dict[bytes, list[list[bytes]]] = {}
        """Batch id → its requests, until the server answers the batch."""
        self.batching = True
        """Whether the calls of one tick travel as one message; off once the server says it cannot batch."""

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
                self._queue(socket, [request_id, method.encode(), packb(kwargs)])
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
        self.fail_pending(RpcError(f"RPC client for {self.address} was closed"))
        self._pending.clear()
        self._outbox.clear()
        self._batches.clear()
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def fail_pending(self, error: Exception) -> None:
        """Every call waiting for a reply raises ``error`` (its server is known to be gone)."""
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)

    def _connect(self) -> zmq.asyncio.Socket:
        if self._socket is None:
            socket = _context().socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(self.address)
            self._socket = socket
            self._receiver = asyncio.ensure_future(self._receive_loop(socket))
        return self._socket

    def _queue(self, socket: zmq.asyncio.Socket, request: list[bytes]) -> None:
        self._outbox.append(request)
        if len(self._outbox) == 1:
            asyncio.get_running_loop().call_soon(self._flush, socket)

    def _flush(self, socket: zmq.asyncio.Socket) -> None:
        """Send this tick's requests (those still waiting): one message, or one each if the server cannot batch."""
        if socket is not self._socket:
            return  # closed since: its calls have failed (a call after the close queues its own flush)
        requests, self._outbox = [r for r in self._outbox if r[0] in self._pending], []
        self._batches = {b: rs for b, rs in self._batches.items() if any(r[0] in self._pending for r in rs)}
        if len(requests) > 1 and self.batching:
            batch_id = next(self._ids).to_bytes(8, "little")
            self._batches[batch_id] = requests
            self._send(socket, [batch_id, _BATCH, packb(requests)], [r[0] for r in requests])
        else:
            for request in requests:
                self._send(socket, request, [request[0]])

    def _send(self, socket: zmq.asyncio.Socket, frames: list[bytes], request_ids: list[bytes]) -> None:
        """Send without waiting; a failed send fails its calls."""
        try:
            socket.send_multipart(frames).add_done_callback(lambda sent: self._fail_unsent(sent, request_ids))
        except zmq.ZMQError as e:
            self._fail(request_ids, e)

    def _fail_unsent(self, sent: asyncio.Future, request_ids: list[bytes]) -> None:
        if not sent.cancelled() and sent.exception() is not None:
            self._fail(request_ids, sent.exception())

    def _fail(self, request_ids: list[bytes], error: BaseException) -> None:
        for request_id in request_ids:
            future = self._pending.get(request_id)
            if future is not None and not future.done():
                future.set_exception(RpcError(f"cannot send to {self.address}: {error}"))

    async def _receive_loop(self, socket: zmq.asyncio.Socket) -> None:
        while True:
            frames = await socket.recv_multipart()
            if len(frames) != 3:
                continue
            reply_id, status, payload = frames
            if status == _BATCH_REPLY:
                self._batches.pop(reply_id, None)
                try:
                    replies = _batch_items(unpackb(payload))
                except DecodeError:
                    continue  # not from an rlbus server: its calls time out
                for request_id, item_status, body in replies:
                    self._resolve(request_id, item_status, body)
            elif reply_id in self._batches:  # a server that cannot batch: send them one by one from now on
                self.batching = False
                for request in self._batches.pop(reply_id):
                    if request[0] in self._pending:
                        self._send(socket, request, [request[0]])
            else:
                self._resolve(reply_id, status, payload)

    def _resolve(self, request_id: bytes, status: bytes, payload: bytes) -> None:
        future = self._pending.get(request_id)
        if future is not None and not future.done():
            future.set_result((status, payload))

    async def __aenter__(self) -> "RpcClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
