"""Async request/reply over ZeroMQ: a ROUTER server and a DEALER client with msgpack frames.

Frames on the wire (after ZeroMQ's routing identity on the server side):

- request: ``[request_id, method, packb(kwargs)]``
- reply:   ``[request_id, b"ok", packb(result)]`` or ``[request_id, b"err", b"<Type>: <message>"]``
- batch:   calls a client starts in the same event-loop tick travel as one message,
  ``[batch_id, b"rpc.batch", packb([[request_id, method, packb(kwargs)], …])]``; the server answers
  the calls that finish at once in one ``[batch_id, b"batch", packb([[request_id, status, payload], …])]``
  and each slower one with its own reply. A server that predates batches answers ``err`` to the
  batch id; the client then sends that batch's calls one by one, and every call after it.

Handlers run off the server's event loop: a synchronous one in a thread of the server's pool, so user
code that is slow or never returns does not hold up the other calls (a batch is answered with the
calls done within :data:`BATCH_WAIT_S`, each later one on its own). ``call_timeout_s`` bounds a call:
past it the call is answered ``CallTimeout`` and ``on_hung(method)`` is told (an env server exits, to be
replaced). A ``SystemExit`` or ``KeyboardInterrupt`` raised by a handler fails that call only. With
``curve_dir`` (:mod:`bus.curve`) the server serves only a client holding that folder's client key.

Request ids let one client carry many concurrent calls; each call waits for its own reply up to
its timeout. A handler that raises sends the error back; the caller raises ``RpcError`` with the
handler's error type and message. No reply in time (peer gone, never started, hung) raises
``RpcTimeoutError`` naming the address and the method. Sockets use LINGER 0, so closing never blocks.
"""

import asyncio
import inspect
import itertools
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from bus import curve
from bus.arrays import packb, unpackb
from bus.errors import DecodeError, RpcError, RpcTimeoutError

Handler = Callable[..., Awaitable[Any] | Any]

_OK = b"ok"
_ERR = b"err"
_BATCH = b"rpc.batch"
"""The method name of a batch request (no handler may have it)."""
_BATCH_REPLY = b"batch"
BATCH_WAIT_S = 0.002
"""How long a batch's reply waits for its calls (run in threads) before answering the ones done; each later
call is answered on its own."""
HANDLER_THREADS = 8
"""Threads of a server's pool for synchronous handlers (one hung call holds one until the server is replaced)."""


class CallTimeout(RpcError):
    """A handler did not return within the server's ``call_timeout_s``."""


class HandlerExit(RpcError):
    """A handler raised ``SystemExit`` or ``KeyboardInterrupt``: its call fails, the server goes on."""


def _run_sync(handler: Handler, kwargs: dict) -> Any:
    """``handler(**kwargs)`` (in a pool thread); an exit it raises becomes :class:`HandlerExit`."""
    try:
        return handler(**kwargs)
    except (SystemExit, KeyboardInterrupt) as e:
        raise HandlerExit(f"{type(e).__name__}({e}) raised by the handler") from None


def _error(e: BaseException) -> tuple[bytes, bytes]:
    return _ERR, f"{type(e).__name__}: {e}".encode()


def _outcome(call: Callable[[], Any]) -> Any:
    """(status, body) of ``call()``, or the awaitable it returned (for the loop to run)."""
    try:
        result = call()
        return result if inspect.isawaitable(result) else (_OK, packb(result))
    except Exception as e:
        return _error(e)


_RUNNING = object()
"""The outcome of a batch's call while its thread runs it."""


class _SyncBatch:
    """The synchronous calls of one batch (``(index, method, payload)``), run one after another by one pool thread;
    the loop takes back the ones not started yet (:meth:`take_rest`) when the batch is slow."""

    def __init__(self, server: "RpcServer", calls: list[tuple[int, bytes, bytes]]):
        self.server, self.calls = server, calls
        self.outcomes: list[Any] = [None] * len(calls)
        """Per call: None (not started), :data:`_RUNNING`, then (status, body) or an awaitable."""
        self._next = 0
        self._lock = threading.Lock()

    def run(self) -> None:
        while (k := self._take()) is not None:
            _, method, payload = self.calls[k]

            def call(method=method, payload=payload):
                handler, kwargs = self.server._resolve_call(method.decode("utf-8", "replace"), payload)
                return _run_sync(handler, kwargs)

            self.outcomes[k] = _outcome(call)

    def _take(self) -> int | None:
        with self._lock:
            if self._next == len(self.calls):
                return None
            self._next += 1
            self.outcomes[self._next - 1] = _RUNNING
            return self._next - 1

    def take_rest(self) -> list[tuple[int, bytes, bytes]]:
        """The calls the thread has not started; it will not start them."""
        with self._lock:
            rest, self._next = self.calls[self._next:], len(self.calls)
        return rest

    def started(self) -> list[int]:
        """Positions of the calls the thread started (after :meth:`take_rest`)."""
        return [k for k, outcome in enumerate(self.outcomes) if outcome is not None]


def _context() -> zmq.asyncio.Context:
    return zmq.asyncio.Context.instance()


class RpcServer:
    """Serves ``handlers`` (method name → sync or async function taking keyword arguments) on ``address``.

    ``await serve()`` binds and answers requests until ``await close()``; each request runs in its own
    task, so a slow async handler does not hold up the others. ``address`` may use port 0
    (``tcp://127.0.0.1:0``); after :meth:`bind` it holds the real endpoint.
    """

    def __init__(self, address: str, handlers: dict[str, Handler], *, call_timeout_s: float | None = None,
                 on_hung: Callable[[str], None] | None = None, max_message_bytes: int | None = None,
                 curve_dir: Path | None = None):
        self.address = address
        self.curve_dir = curve_dir
        """CURVE key folder (:mod:`bus.curve`): serve only its client key holder. None: any peer."""
        self._auth: Any = None
        self.max_message_bytes = max_message_bytes
        """Largest inbound message (ZeroMQ ``MAXMSGSIZE``); a peer that sends a bigger one is disconnected
        unanswered. None: no cap."""
        self.handlers = dict(handlers)
        self.call_timeout_s = call_timeout_s
        """Longest one call may run before it is answered ``CallTimeout`` (None: no bound)."""
        self.on_hung = on_hung
        self._pool = ThreadPoolExecutor(HANDLER_THREADS, thread_name_prefix="rpc-handler")
        self._socket: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task | None = None
        self._requests: set[asyncio.Task] = set()
        self._closing = False

    def bind(self) -> str:
        """Bind the ROUTER socket (idempotent); returns the bound endpoint."""
        if self._socket is None:
            socket = _context().socket(zmq.ROUTER)
            socket.setsockopt(zmq.LINGER, 0)
            if self.max_message_bytes is not None:
                socket.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            try:
                if self.curve_dir is not None:
                    self._auth = curve.secure_server(socket, self.curve_dir)
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
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._pool.shutdown(wait=False, cancel_futures=True)

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
        """One reply for the batch's calls done within :data:`BATCH_WAIT_S`; the others answer on their own. The
        synchronous calls run one after another in one pool thread (one hand-off for all); when that takes longer,
        the calls it has not started yet are taken back and run each on its own."""
        try:
            calls = _batch_items(unpackb(payload))
        except DecodeError as e:
            await self._send([identity, batch_id, _ERR, f"DecodeError: {e}".encode()])
            return
        sync = [self._is_sync(method) for _, method, _ in calls]
        replies = {i: asyncio.ensure_future(self._reply(method, body))
                   for i, (_, method, body) in enumerate(calls) if not sync[i]}
        batch = _SyncBatch(self, [(i, method, body) for i, (_, method, body) in enumerate(calls) if sync[i]])
        job = asyncio.get_running_loop().run_in_executor(self._pool, batch.run) if batch.calls else None
        try:
            await asyncio.wait([*replies.values(), *([job] if job else [])], timeout=BATCH_WAIT_S)
            for i, method, body in batch.take_rest():
                replies[i] = asyncio.ensure_future(self._reply(method, body))
            ready = {i: reply.result() for i, reply in replies.items() if reply.done()}
            for k in batch.started():
                i, method, _ = batch.calls[k]
                if isinstance(batch.outcomes[k], tuple):
                    ready[i] = batch.outcomes[k]
                else:
                    replies[i] = asyncio.ensure_future(self._finish(batch, k, job))
            await self._send([identity, batch_id, _BATCH_REPLY, packb([[calls[i][0], *r] for i, r in ready.items()])])
            late = [(calls[i][0], reply) for i, reply in replies.items() if i not in ready]
            await asyncio.gather(*(self._answer_late(identity, request_id, reply) for request_id, reply in late))
        except asyncio.CancelledError:
            for reply in replies.values():
                reply.cancel()
            raise

    def _is_sync(self, method: bytes) -> bool:
        handler = self.handlers.get(method.decode("utf-8", "replace"))
        return handler is not None and not inspect.iscoroutinefunction(handler)

    async def _finish(self, batch: "_SyncBatch", k: int, job: asyncio.Future) -> tuple[bytes, bytes]:
        """(status, body) of call ``k`` of ``batch``: still running in the batch's thread (awaited within
        ``call_timeout_s``), or one that returned an awaitable."""
        method = batch.calls[k][1].decode("utf-8", "replace")
        if batch.outcomes[k] is _RUNNING:
            bound = asyncio.timeout(self.call_timeout_s)
            try:
                async with bound:
                    await asyncio.shield(job)
            except TimeoutError:
                if bound.expired():
                    return self._timed_out(method)
                raise
        outcome = batch.outcomes[k]
        return outcome if isinstance(outcome, tuple) else await self._bounded(method, outcome)

    async def _answer_late(self, identity: bytes, request_id: bytes, reply: asyncio.Future) -> None:
        status, body = await reply
        await self._send([identity, request_id, status, body])

    async def _reply(self, method: bytes, payload: bytes) -> tuple[bytes, bytes]:
        """(status, body) of one call: the packed result, or the handler's error as ``Type: message``."""
        name = method.decode("utf-8", "replace")
        try:
            handler, kwargs = self._resolve_call(name, payload)
        except Exception as e:
            return _error(e)
        if inspect.iscoroutinefunction(handler):
            return await self._bounded(name, handler(**kwargs))
        return await self._bounded(name, asyncio.get_running_loop().run_in_executor(
            self._pool, _run_sync, handler, kwargs))

    async def _bounded(self, method: str, work: Awaitable) -> tuple[bytes, bytes]:
        """(status, body) of awaiting ``work`` (a handler's coroutine, or its run in a pool thread, which may return
        a coroutine to run here) within ``call_timeout_s``."""
        bound = asyncio.timeout(self.call_timeout_s)
        try:
            async with bound:
                result = await work
                while inspect.isawaitable(result):  # a synchronous handler that returned a coroutine
                    result = await result
        except asyncio.CancelledError:
            raise
        except TimeoutError as e:
            return self._timed_out(method) if bound.expired() else _error(e)
        except (SystemExit, KeyboardInterrupt) as e:
            return _error(HandlerExit(f"{type(e).__name__}({e}) raised by the handler"))
        except Exception as e:
            return _error(e)
        try:
            return _OK, packb(result)
        except Exception as e:
            return _error(e)

    async def _send(self, frames: list[bytes]) -> None:
        if self._socket is not None:
            await self._socket.send_multipart(frames)

    def _timed_out(self, method: str) -> tuple[bytes, bytes]:
        if self.on_hung is not None:
            self.on_hung(method)
        return _error(CallTimeout(f"{method!r} did not return within {self.call_timeout_s:g}s"))

    def _resolve_call(self, method: str, payload: bytes) -> tuple[Handler, dict]:
        """The handler of ``method`` and its keyword arguments (RpcError/DecodeError when there is none/they
        are malformed)."""
        handler = self.handlers.get(method)
        if handler is None:
            raise RpcError(f"unknown method {method!r}; this server answers {sorted(self.handlers)}")
        kwargs = unpackb(payload)
        if not isinstance(kwargs, dict):
            raise DecodeError(f"arguments of {method!r} must be a map, got {type(kwargs).__name__}")
        return handler, kwargs


def _batch_items(items: Any) -> list[tuple[bytes, bytes, bytes]]:
    """The ``[id, method-or-status, payload]`` triples of a batch message, checked (DecodeError if malformed)."""
    if not isinstance(items, list) or not all(
            isinstance(item, list) and len(item) == 3 and all(isinstance(part, bytes) for part in item)
            for item in items):
        raise DecodeError("a batch must be a list of [id, name, payload] byte triples")
    return [tuple(item) for item in items]


class RpcClient:
    """Calls methods of the :class:`RpcServer` at ``address``; safe for concurrent calls in one event loop."""

    def __init__(self, address: str, timeout_s: float = 10.0, curve_dir: Path | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self.curve_dir = curve_dir
        """CURVE key folder (:mod:`bus.curve`) of a server that needs it; None: plain."""
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
            if self.curve_dir is not None:
                curve.secure_client(socket, self.curve_dir)
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
