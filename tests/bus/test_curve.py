"""CURVE on an RPC server: only the holder of the run's client key is served (bus/curve.py)."""

import asyncio
import shutil

import pytest

from bus import curve
from bus.errors import RpcTimeoutError
from bus.local_redis import free_port
from bus.rpc import RpcClient, RpcServer


async def test_a_curve_server_serves_only_the_holder_of_its_client_key(tmp_path):
    """Before, an env server on tcp:// answered any peer that reached its port (examples and answers readable)."""
    keys, other = curve.generate(tmp_path / "run"), curve.generate(tmp_path / "other")
    assert {(keys / f"{n}.secret").stat().st_mode & 0o777 for n in curve.PAIRS} == {0o600}
    impostor = tmp_path / "impostor"  # knows the server's public key, holds a client key of its own
    shutil.copytree(other, impostor)
    shutil.copy(keys / "server.public", impostor / "server.public")
    server = RpcServer(f"tcp://127.0.0.1:{free_port()}", {"echo": lambda x: x}, curve_dir=keys)
    address = server.bind()
    serving = asyncio.create_task(server.serve())
    try:
        async with RpcClient(address, 5.0, curve_dir=keys) as client:
            assert await client.call("echo", x=7) == 7
        for folder in (None, other, impostor):
            async with RpcClient(address, 1.0, curve_dir=folder) as stranger:
                with pytest.raises(RpcTimeoutError):
                    await stranger.call("echo", x=7)
        async with RpcClient(address, 5.0, curve_dir=keys) as client:  # still serving its own
            assert await client.call("echo", x=8) == 8
    finally:
        await server.close()
        await serving


def test_generating_again_keeps_the_keys(tmp_path):
    folder = curve.generate(tmp_path / "curve")
    before = (folder / "client.secret").read_bytes()
    assert (curve.generate(folder) / "client.secret").read_bytes() == before
