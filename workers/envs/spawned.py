"""The server process an env handle spawns and owns: where it listens, how it starts, how it ends.

Every env handle that spawns its server (rlbus's env server, verifiers' ``serve_env``, an OpenEnv app under
uvicorn) starts it the same way: stdin closed, killed with its owner (PDEATHSIG), its exit code a future that fails
the calls in flight at once. A worker that ``rlbus run`` forked from its preloaded server asks that server for
rlbus's env server too (:class:`ForkedServer`: no interpreter start, no imports again), watched by the server for
its owner's end; anything else, or a server that does not answer, is exec'd. A server on ZeroMQ listens on an
``ipc://`` socket in a private folder (mode 0700, only this user can connect) whose name carries the owner's pid: a
rollout worker killed with SIGKILL cannot remove its folder, so the next handle that spawns a server on this machine
sweeps the folders of owners that are gone.
"""

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Self

from workers.forked import FORK_SOCKET_VAR, ForkedProcess, Forker, ForkUnavailable
from workers.lifecycle import die_with_parent, stop_child

SOCKET_DIR_PREFIX = "rlbus-env-"
"""Name prefix of a spawned server's socket folder in the temp dir: ``rlbus-env-<owner pid>-<random>``."""


FORK_TIMEOUT_S = 5.0
"""How long a fork of an env server waits for the fork server's answer before the server is exec'd instead."""

FORKED_MODULE = ["-m", "workers.cli", "env"]
"""The command (after the interpreter) of the one server that is forked: rlbus's env server."""


class ForkedServer:
    """An env server forked by ``rlbus run``'s fork server, as its handle and :func:`stop_child` see a process."""

    def __init__(self, process: ForkedProcess):
        self._process = process
        self.pid = process.pid
        loop = asyncio.get_running_loop()
        self.exited: asyncio.Future = loop.create_future()
        """Done with the exit code (which comes over the fork server's connection, read by a thread)."""
        threading.Thread(target=self._wait, args=(loop,), name=f"rlbus-env-{self.pid}", daemon=True).start()

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def _wait(self, loop: asyncio.AbstractEventLoop) -> None:
        code = self._process.wait()
        with contextlib.suppress(RuntimeError):  # the loop closed first
            loop.call_soon_threadsafe(lambda: self.exited.done() or self.exited.set_result(code))


async def fork_server(argv: list[str], env: dict[str, str]) -> ForkedServer | None:
    """``argv`` forked by the fork server that forked this worker (:data:`FORK_SOCKET_VAR`), its output where this
    worker's goes, SIGTERMed when this worker ends; None (exec it) unless it is rlbus's env server, this worker was
    forked and writes to a file, and the server forks it within :data:`FORK_TIMEOUT_S`."""
    socket_path = os.environ.get(FORK_SOCKET_VAR)
    log = os.readlink("/proc/self/fd/1") if os.path.exists("/proc/self/fd/1") else ""
    if socket_path is None or argv[1:4] != FORKED_MODULE or not os.path.isfile(log):
        return None
    forker = Forker(socket_path, server_alive=lambda: False, timeout_s=FORK_TIMEOUT_S)
    try:
        process = await asyncio.to_thread(forker.spawn, argv, env, log, os.getpid())
    except ForkUnavailable:
        return None
    return ForkedServer(process)


class ServerProcess:
    """One spawned server at a time: started, stopped and started again by its handle."""

    def __init__(self) -> None:
        self.process: asyncio.subprocess.Process | ForkedServer | None = None
        self.exited: asyncio.Future | None = None
        """Done with the exit code when the process ends; None before the first start and after a stop."""
        self._socket_dir: str | None = None

    @property
    def pid(self) -> int | None:
        """Process id of the running server (None when none runs)."""
        return self.process.pid if self.process is not None else None

    @property
    def forked(self) -> bool:
        """Whether the running server was forked by the fork server (else exec'd, or none runs)."""
        return isinstance(self.process, ForkedServer)

    def socket_address(self, generation: int) -> str:
        """A fresh ``ipc://`` address for the server's ``generation``-th start, in this handle's private folder."""
        if self._socket_dir is None:
            sweep_orphaned_socket_dirs()
            self._socket_dir = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
        return f"ipc://{self._socket_dir}/{generation}.sock"

    async def start(self, argv: list[str], env: dict[str, str], own_session: bool = False) -> None:
        """Start ``argv``; ``own_session``: in a session of its own, so a Ctrl-C to the run's process group reaches
        only the handle's worker, which stops the server when it has drained (a forked server joins this worker's
        process group instead, as an exec'd one without ``own_session`` would be in it)."""
        forked = await fork_server(argv, env)
        if forked is not None:
            self.process, self.exited = forked, forked.exited
            return
        preexec = die_with_parent(os.getpid()) if sys.platform.startswith("linux") else None
        self.process = await asyncio.create_subprocess_exec(*argv, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                            preexec_fn=preexec, start_new_session=own_session)
        self.exited = asyncio.ensure_future(self.process.wait())

    async def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after a grace period); nothing when none runs."""
        process, exited = self.process, self.exited
        self.process = self.exited = None
        if process is not None and exited is not None:
            await stop_child(process, exited)

    async def close(self) -> None:
        """Stop the server and remove its socket folder."""
        await self.stop()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None


def sweep_orphaned_socket_dirs(tmp_dir: str | None = None) -> list[Path]:
    """Remove this user's socket folders whose owner process no longer exists; the folders removed."""
    removed = []
    for path in Path(tmp_dir or tempfile.gettempdir()).glob(f"{SOCKET_DIR_PREFIX}*-*"):
        owner = path.name.removeprefix(SOCKET_DIR_PREFIX).split("-", 1)[0]
        try:
            if not owner.isdigit() or path.stat().st_uid != os.getuid() or _alive(int(owner)):
                continue
        except OSError:  # swept by another handle meanwhile
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process holds the pid
        return True
    return True


class ServerHandle:
    """What every env handle shares: the server it may have spawned, and a start that leaves nothing behind when
    connecting fails (the spawned server stopped, its socket folder removed)."""

    def __init__(self) -> None:
        self._server = ServerProcess()

    @property
    def pid(self) -> int | None:
        """Process id of the spawned server (None for an external one)."""
        return self._server.pid

    async def close(self) -> None:
        await self._server.close()

    async def _connected(self, connect: Coroutine[Any, Any, Any]) -> Self:
        """This handle once ``connect`` (spawning the server, or reaching it) succeeded; closed when it failed."""
        try:
            await connect
        except BaseException:
            await self.close()
            raise
        return self
