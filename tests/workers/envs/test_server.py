"""Env servers as real processes: every method of every built-in, crash → restart + retry, dead addresses."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bus.errors import RpcError, RpcTimeoutError
from bus.rpc import RpcClient
from tests.workers.envs.test_envs import SELF_CONTAINED
from workers.env_config import EnvConfig
from workers.envs.server import EnvHandle


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_every_method_of_every_builtin_answers():
    async def one(env_id: str) -> None:
        handle = await EnvHandle.start(EnvConfig(id=env_id, name=f"my_{env_id}", max_turns=3), timeout_s=10)
        try:
            info = await handle.info()
            assert info["name"] == f"my_{env_id}" and info["size"] > 0 and info["reward_names"]
            assert info["max_turns"] == (3 if env_id == "guess_number" else 1)
            assert isinstance(await handle.example(index=1), dict)
            first = await handle.initial(index=1)
            messages = [*first["messages"], {"role": "assistant", "content": "42"}]
            stepped = await handle.step(index=1, messages=messages, state=first["state"])
            assert isinstance(stepped["done"], bool) and stepped["state"]["turn"] == 1
            assert stepped["done"] is (env_id != "guess_number" or (await handle.example(index=1))["secret"] == 42)
            scored = await handle.score(index=1, messages=messages, state=stepped["state"])
            assert 0.0 <= scored["reward"] <= 1.0 and set(scored["metrics"]) == set(info["reward_names"])
            with pytest.raises(RpcError, match="IndexError: index 999999 is out of range"):
                await handle.example(index=999999)
        finally:
            pid = handle.pid
            await handle.close()
        assert _gone(pid)

    await asyncio.gather(*(one(env_id) for env_id in SELF_CONTAINED))


async def test_killed_server_is_restarted_and_the_call_retried():
    handle = await EnvHandle.start(EnvConfig(id="reverse_text", args={"num_examples": 20}), timeout_s=10)
    try:
        expected = await handle.example(index=3)
        first_pid = handle.pid
        os.kill(first_pid, signal.SIGKILL)
        # Concurrent calls after the crash: one restart, every call answered.
        results = await asyncio.gather(*(handle.example(index=3) for _ in range(5)))
        assert results == [expected] * 5
        assert handle.restarts == 1 and handle.pid != first_pid
    finally:
        await handle.close()


CRASHY = '''
import os
from pathlib import Path
from workers.envs import Environment, RewardFunc, Rubric


def make(marker):
    def crash_once(example, messages, state):
        if not Path(marker).exists():
            Path(marker).touch()
            os._exit(3)  # die in the middle of the call
        return 0.5
    return Environment("crashy", [{"i": 0}], lambda ex: [{"role": "user", "content": "hi"}],
                       Rubric([RewardFunc(crash_once)]))
'''


async def test_server_dying_mid_call_is_restarted_and_the_call_retried(tmp_path, monkeypatch):
    (tmp_path / "crashy_env.py").write_text(CRASHY)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    marker = tmp_path / "crashed"

    config = EnvConfig(id="crashy_env:make", args={"marker": str(marker)})
    handle = await EnvHandle.start(config, timeout_s=30)
    try:
        start = time.monotonic()
        assert (await handle.score(index=0, messages=[], state={}))["reward"] == 0.5
        assert time.monotonic() - start < 20  # noticed the exit, did not wait out the 30 s timeout
        assert marker.exists() and handle.restarts == 1
    finally:
        await handle.close()


async def test_dead_external_address_fails_within_its_timeout():
    config = EnvConfig(id="reverse_text", address="tcp://127.0.0.1:1")
    start = time.monotonic()
    with pytest.raises(RpcTimeoutError, match=r"tcp://127\.0\.0\.1:1 to 'info' within 0\.5s"):
        await EnvHandle.start(config, timeout_s=0.5)
    assert time.monotonic() - start < 2.0


async def test_failing_env_factory_reports_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(RpcError, match="exited before answering"):
        await EnvHandle.start(EnvConfig(id="echo_chars", args={"bogus": 1}), timeout_s=5)
    assert time.monotonic() - start < 30


async def test_cli_serves_a_config_env_and_external_handle_uses_it(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[[env]]\nid = "guess_number"\nname = "guess"\nargs = {high = 10, num_examples = 7}\n')
    address = f"ipc://{tmp_path}/guess.sock"
    process = subprocess.Popen([sys.executable, "-m", "workers.cli", "env", "@", str(config), "--name", "guess",
                                "--bind", address])

    try:
        handle = await EnvHandle.start(EnvConfig(id="guess_number", address=address), timeout_s=30)
        try:
            info = await handle.info()
            assert info == {"name": "guess", "size": 7, "max_turns": 8, "reward_names": ["guess", "found", "turns"],
                            "has_reference": False}
            assert 1 <= (await handle.example(index=6))["secret"] <= 10
        finally:
            await handle.close()
        assert process.poll() is None  # an external server is not ours to stop
        async with RpcClient(address, timeout_s=5) as client:
            assert (await client.call("info"))["size"] == 7
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0


async def test_a_hung_call_is_bounded_its_server_replaced_and_its_neighbours_answered():
    """User code that never returns: the call fails within the handle's timeout (CallTimeout, not a silent wait),
    the call batched with it is answered, and the server is replaced so later calls go on."""
    handle = await EnvHandle.start(EnvConfig(id="tests.workers.envs.hung_envs:hangs_on_zero"), timeout_s=2)
    try:
        first_pid = handle.pid
        hung, neighbour = await asyncio.gather(handle.example(index=0), handle.example(index=1),
                                               return_exceptions=True)
        assert isinstance(hung, RpcError) and "CallTimeout" in str(hung), hung
        assert neighbour == {"text": "item 1"}
        deadline = time.monotonic() + 10
        while not _gone(first_pid) and time.monotonic() < deadline:  # it exits to be replaced
            await asyncio.sleep(0.05)
        assert await handle.example(index=2) == {"text": "item 2"}
        assert handle.restarts == 1 and handle.pid != first_pid
    finally:
        await handle.close()


async def test_a_spawned_servers_args_stay_out_of_its_command_line():
    """Env args may hold secrets (API keys of a remote env): `ps` on the host must not show them."""
    handle = await EnvHandle.start(EnvConfig(id="reverse_text", args={"num_examples": 7}), timeout_s=10)
    try:
        with open(f"/proc/{handle.pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert not any(b"num_examples" in arg for arg in argv), argv
        assert (await handle.info())["size"] == 7  # the args still reached the env
    finally:
        await handle.close()


OWNER = """
import asyncio, sys
from workers.env_config import EnvConfig
from workers.envs.server import EnvHandle

async def main():
    handle = await EnvHandle.start(EnvConfig(id="echo_chars"), timeout_s=10)
    print("spawned", handle.address, handle.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


async def test_a_socket_folder_left_by_a_killed_owner_is_swept_by_the_next_spawn():
    """A rollout worker killed with SIGKILL cannot remove its env server's socket folder: the next spawn does."""
    with subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True) as owner:
        try:
            line = next(line for line in owner.stdout if line.startswith("spawned "))
            _, address, server_pid = line.split()
        finally:
            owner.kill()
    folder = Path(address.removeprefix("ipc://")).parent
    assert folder.is_dir() and oct(folder.stat().st_mode & 0o777) == "0o700"
    deadline = time.monotonic() + 10
    while Path(f"/proc/{server_pid}").exists():  # its server follows it (PDEATHSIG)
        assert time.monotonic() < deadline, "the env server outlived its killed owner"
        await asyncio.sleep(0.05)
    handle = await EnvHandle.start(EnvConfig(id="echo_chars"), timeout_s=10)
    try:
        assert not folder.exists()
        assert Path(handle.address.removeprefix("ipc://")).parent.is_dir()
    finally:
        await handle.close()
    assert not Path(handle.address.removeprefix("ipc://")).parent.exists()


def _serve_tcp(tmp_path, *flags: str) -> tuple[subprocess.Popen, str, object]:
    from bus.local_redis import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    log = tmp_path / f"env-{len(list(tmp_path.glob('env-*.log')))}.log"
    with open(log, "w") as out:  # the child writes to its own copy
        proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "env", "--id", "echo_chars", "--bind", address,
                                 *flags], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while "env_server_started" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.1)
    return proc, address, log


async def test_an_env_server_with_the_runs_curve_keys_serves_only_their_holders(tmp_path):
    """`rlbus env --curve-dir` (keys made there if missing): the run's workers (rollout.curve_dir) are served, a
    peer without the keys gets nothing. Before, any peer that reached a tcp:// port was served."""
    keys = tmp_path / "curve"
    proc, address, log = _serve_tcp(tmp_path, "--curve-dir", str(keys))
    try:
        handle = await EnvHandle.start(EnvConfig(id="echo_chars", address=address), timeout_s=5.0,
                                       curve_dir=str(keys))
        try:
            assert (await handle.info())["size"] > 0
        finally:
            await handle.close()
        async with RpcClient(address, 1.0) as stranger:
            with pytest.raises(RpcTimeoutError):
                await stranger.call("info")
        assert "env_server_unauthenticated" not in log.read_text()
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_tcp_env_server_without_keys_warns(tmp_path):
    proc, address, log = _serve_tcp(tmp_path)
    try:
        deadline = time.monotonic() + 10
        while "env_server_unauthenticated" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        assert "--curve-dir" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(10)
