"""ZeroMQ RPC: round trip, concurrency, remote errors, timeouts and dead peers."""

import asyncio
import sys
import threading
import time
from contextlib import asynccontextmanager

import numpy as np
import pytest

from bus.arrays import from_wire, packb
from bus.errors import RpcError, RpcTimeoutError
from bus.rpc import RpcClient, RpcServer


async def _slow_echo(value, delay_s):
    await asyncio.sleep(delay_s)
    return value


def _fail(**_):
    raise ValueError("bad index 7; use 0..3")


HANDLERS = {
    "add": lambda a, b: a + b,
    "echo": _slow_echo,
    "fail": _fail,
    "array": lambda n: np.arange(n, dtype=np.int32),
}


@asynccontextmanager
async def served(address="tcp://127.0.0.1:0"):
    async with served_with(HANDLERS, address) as pair:
        yield pair


@asynccontextmanager
async def served_with(handlers, address="tcp://127.0.0.1:0", **options):
    server = RpcServer(address, handlers, **options)
    server.bind()
    task = asyncio.ensure_future(server.serve())
    client = RpcClient(server.address, timeout_s=2.0)
    try:
        yield server, client
    finally:
        await client.close()
        await server.close()
        await task


async def test_round_trip_tcp_and_ipc(tmp_path):
    for address in ("tcp://127.0.0.1:0", f"ipc://{tmp_path}/rpc.sock"):
        async with served(address) as (_, client):
            assert await client.call("add", a=2, b=3) == 5
            assert await client.call("echo", value={"x": [1, "two", b"3"]}, delay_s=0) == {"x": [1, "two", b"3"]}
            array = from_wire(await client.call("array", n=5))
            assert array.tolist() == [0, 1, 2, 3, 4]


async def test_concurrent_calls_on_one_client_get_their_own_replies():
    async with served() as (_, client):
        start = time.monotonic()
        # Later requests finish first: replies must be matched by request id, not order.
        delays = [0.3 - 0.01 * i for i in range(20)]
        results = await asyncio.gather(*(client.call("echo", value=i, delay_s=d) for i, d in enumerate(delays)))
        assert results == list(range(20))
        assert time.monotonic() - start < 1.5  # served concurrently, not one after another


async def test_handler_error_is_raised_on_the_caller_with_type_and_message():
    async with served() as (_, client):
        with pytest.raises(RpcError, match=r"^ValueError: bad index 7; use 0\.\.3$"):
            await client.call("fail")
        with pytest.raises(RpcError, match="unknown method 'nope'"):
            await client.call("nope")
        with pytest.raises(RpcError, match="TypeError"):
            await client.call("add", a=1)
        assert await client.call("add", a=1, b=1) == 2  # the server keeps serving


async def test_slow_handler_times_out_naming_address_and_method():
    async with served() as (server, client):
        start = time.monotonic()
        with pytest.raises(RpcTimeoutError) as info:
            await client.call("echo", value=1, delay_s=5, timeout_s=0.3)
        assert time.monotonic() - start < 1.0
        assert server.address in str(info.value) and "'echo'" in str(info.value)
        assert await client.call("add", a=1, b=2) == 3  # a late reply does not confuse later calls


async def test_dead_peer_fails_within_timeout(tmp_path):
    for address in (f"ipc://{tmp_path}/nobody.sock", "tcp://127.0.0.1:1"):
        client = RpcClient(address, timeout_s=0.5)
        start = time.monotonic()
        with pytest.raises(RpcTimeoutError, match=address.replace(".", r"\.")):
            await client.call("info")
        assert time.monotonic() - start < 1.5
        await client.close()


async def test_server_gone_mid_session_fails_within_timeout():
    server = RpcServer("tcp://127.0.0.1:0", HANDLERS)
    task = asyncio.ensure_future(server.serve())
    await asyncio.sleep(0)
    client = RpcClient(server.address, timeout_s=0.5)
    assert await client.call("add", a=1, b=1) == 2
    await server.close()
    await task
    start = time.monotonic()
    with pytest.raises(RpcTimeoutError):
        await client.call("add", a=1, b=1)
    assert time.monotonic() - start < 1.5
    await client.close()


async def test_bind_to_busy_address_says_so():
    async with served() as (server, _):
        with pytest.raises(RpcError, match="cannot bind"):
            RpcServer(server.address, HANDLERS).bind()


def _count_messages(server: RpcServer) -> dict[str, int]:
    """Wrap the server's answer methods to count request messages: single calls and batches."""
    counts = {"single": 0, "batch": 0}
    single, batch = server._answer, server._answer_batch

    def counted(kind, answer):
        def wrapper(*frames):
            counts[kind] += 1
            return answer(*frames)
        return wrapper

    server._answer, server._answer_batch = counted("single", single), counted("batch", batch)
    return counts


async def test_calls_started_together_travel_as_one_message_and_get_their_own_replies():
    async with served() as (server, client):
        counts = _count_messages(server)
        calls = [client.call("add", a=i, b=1) for i in range(8)] + [client.call("fail"), client.call("nope")]
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert results[:8] == [i + 1 for i in range(8)]
        assert str(results[8]) == "ValueError: bad index 7; use 0..3"
        assert "unknown method 'nope'" in str(results[9])
        assert counts == {"single": 0, "batch": 1}
        assert await client.call("add", a=1, b=1) == 2
        assert counts == {"single": 1, "batch": 1}


async def test_a_slow_call_in_a_batch_does_not_hold_up_the_fast_ones():
    async with served() as (_, client):
        slow = asyncio.ensure_future(client.call("echo", value="slow", delay_s=0.5))
        fast = asyncio.ensure_future(client.call("add", a=2, b=2))
        assert await fast == 4
        assert not slow.done()
        assert await slow == "slow"


async def test_a_server_without_batches_gets_the_calls_one_by_one():
    async with served() as (server, client):
        server._answer_batch = server._answer  # an older server: "rpc.batch" is an unknown method to it
        results = await asyncio.gather(*(client.call("add", a=i, b=i) for i in range(5)))
        assert results == [0, 2, 4, 6, 8]
        assert not client.batching
        assert await asyncio.gather(client.call("add", a=1, b=2), client.call("add", a=3, b=4)) == [3, 7]


async def test_malformed_batch_is_answered_with_an_error_and_the_server_keeps_serving():
    import zmq
    import zmq.asyncio

    async with served() as (server, client):
        raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(server.address)
        for payload in (b"\xc1", packb([[b"1", "add", b"x"]]), packb({"not": "a list"})):
            await raw.send_multipart([b"b1", b"rpc.batch", payload])
            reply = await asyncio.wait_for(raw.recv_multipart(), 2.0)
            assert reply[0] == b"b1" and reply[1] == b"err" and reply[2].startswith(b"DecodeError")
        raw.close(linger=0)
        assert await client.call("add", a=1, b=1) == 2


async def test_a_hung_sync_handler_is_bounded_and_the_server_keeps_answering():
    """User code that never returns runs off the server's event loop: its neighbours are answered, the call fails
    once past call_timeout_s, and the server reports it hung (an env server then exits to be replaced)."""
    release, hung = threading.Event(), []
    server = RpcServer("tcp://127.0.0.1:0", {**HANDLERS, "hang": lambda: release.wait(30)},
                       call_timeout_s=0.5, on_hung=hung.append)
    server.bind()
    serving = asyncio.ensure_future(server.serve())
    client = RpcClient(server.address, timeout_s=3.0)
    try:
        stuck = asyncio.ensure_future(client.call("hang"))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        assert await client.call("add", a=1, b=2) == 3
        assert time.monotonic() - started < 0.4
        with pytest.raises(RpcError, match="CallTimeout: 'hang' did not return within 0.5s"):
            await stuck
        assert hung == ["hang"]
    finally:
        release.set()
        await client.close()
        await server.close()
        await serving


async def test_a_slow_sync_call_in_a_batch_does_not_hold_up_its_neighbours():
    handlers = {**HANDLERS, "nap": lambda s: time.sleep(s) or "rested"}
    async with served_with(handlers) as (_, client):
        slow = asyncio.ensure_future(client.call("nap", s=1.0))
        fast = asyncio.ensure_future(client.call("add", a=2, b=2))  # the same tick: one batch with the slow one
        started = time.monotonic()
        assert await fast == 4
        assert time.monotonic() - started < 0.5 and not slow.done()
        assert await slow == "rested"


async def test_system_exit_in_user_code_fails_only_its_own_call():
    async with served_with({**HANDLERS, "quit": lambda: sys.exit(3)}) as (_, client):
        results = await asyncio.gather(client.call("quit"), client.call("add", a=1, b=1), return_exceptions=True)
        assert isinstance(results[0], RpcError) and "SystemExit" in str(results[0])
        assert results[1] == 2
        assert await client.call("add", a=2, b=2) == 4  # still serving


async def test_a_message_over_the_cap_is_dropped_and_the_server_keeps_serving():
    """Anyone who reaches the port cannot make the server take a 400 MiB frame: past max_message_bytes the peer
    is dropped unanswered, and other clients are served."""
    async with served_with(HANDLERS, max_message_bytes=2**20) as (server, client):
        big = RpcClient(server.address, timeout_s=0.5)
        try:
            with pytest.raises(RpcTimeoutError):
                await big.call("add", a=b"x" * 2 * 2**20, b=b"")
        finally:
            await big.close()
        assert await client.call("add", a=1, b=2) == 3
