"""Workers forked from ``rlbus run``'s preloaded server (:mod:`workers.run.forkserver`), as the process that asked
for them sees them: the supervisor, or a forked rollout worker asking for its env servers.

    forker = Forker(socket_path, server_alive=lambda: server.poll() is None)
    proc = forker.spawn([sys.executable, "-m", "workers.cli", "trainer", "@", "cfg.toml"], env, "logs/trainer.log")
    proc.poll(); proc.wait(timeout=5); os.killpg(proc.pid, signal.SIGTERM)

:class:`ForkedProcess` offers the part of :class:`subprocess.Popen` the supervisor uses (``pid``, ``poll``, ``wait``,
``returncode``). The worker is the server's child, so its exit code comes over the connection that asked for it. When
the server dies its workers get SIGTERM (their death signal); a worker whose connection closed without an exit code
counts as exited once its process is gone, with ``-SIGTERM``. Every forked worker finds the server's socket in
:data:`FORK_SOCKET_VAR`; a child it asks for with ``watch`` = its own pid gets SIGTERM when it ends, as an exec'd
child's death signal would give it.
"""

import json
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

FORK_SOCKET_VAR = "RLBUS_FORK_SOCKET"
"""Set in every forked worker's environment: the socket of the server that forked it."""

ROOM_BYTES = 2048
"""Padding of the server's command line: room for each worker's own (``ps`` shows the worker's; longer ones are cut)."""

SPAWN_TIMEOUT_S = 120.0
"""How long a spawn waits for the server's answer (the first waits for its preload)."""


class ForkUnavailable(Exception):
    """The server cannot fork this worker now (not started yet, gone, or it refused the request)."""


def forkserver_argv(socket_path: str, modules: list[str], model: str | None) -> list[str]:
    """The server's command line: preload ``modules`` and the architecture of ``model``, serve on ``socket_path``."""
    return [sys.executable, "-m", "workers.run.forkserver", "--socket", socket_path, "--preload", *modules,
            *(["--model", model] if model else []), "--room", " " * ROOM_BYTES]


class ForkedProcess:
    """A worker forked by the server."""

    def __init__(self, pid: int, conn: socket.socket, buffered: bytes = b""):
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self._buffer = buffered
        self._server_gone = False
        self._parse()
        if self.returncode is not None:  # it ended before its pid was even read
            conn.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout)
            self._read(left)
        return self.returncode

    def _read(self, timeout: float) -> None:
        if not self._server_gone and select.select([self._conn], [], [], timeout)[0]:
            try:
                data = self._conn.recv(4096)
            except OSError:
                data = b""
            self._buffer += data
            self._server_gone = not data
            self._parse()
        elif self._server_gone:
            time.sleep(timeout)
        if self.returncode is None and self._server_gone and not _exists(self.pid):
            self.returncode = -signal.SIGTERM  # the server died; its death signal ended the worker
        if self.returncode is not None:
            self._conn.close()

    def _parse(self) -> None:
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            message = json.loads(line)
            if "exit" in message:
                self.returncode = int(message["exit"])


class Forker:
    """Asks the server at ``socket_path`` for workers."""

    def __init__(self, socket_path: str, server_alive: Callable[[], bool], timeout_s: float = SPAWN_TIMEOUT_S):
        self.socket_path = socket_path
        self.server_alive = server_alive
        """Whether the server's process runs (a socket not bound yet is then worth waiting for)."""
        self.timeout_s = timeout_s

    def spawn(self, argv: list[str], env: dict[str, str], log: Path | str, watch: int | None = None) -> ForkedProcess:
        """Fork ``argv`` with ``env`` (and :data:`FORK_SOCKET_VAR`), its output appended to ``log``, SIGTERMed when
        process ``watch`` ends; :class:`ForkUnavailable` when the server does not answer with a pid."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(self.timeout_s)
        request = {"argv": argv, "env": {**env, FORK_SOCKET_VAR: self.socket_path}, "log": str(Path(log).resolve()),
                   "watch": watch}
        buffer = b""
        try:
            self._connect(conn)
            conn.sendall(json.dumps(request).encode() + b"\n")
            while b"\n" not in buffer:
                data = conn.recv(4096)
                if not data:
                    raise ForkUnavailable("the fork server closed the connection")
                buffer += data
        except (OSError, ForkUnavailable) as e:
            conn.close()
            raise ForkUnavailable(f"no fork server at {self.socket_path}: {e}") from e
        line, rest = buffer.split(b"\n", 1)
        reply = json.loads(line)
        if "pid" not in reply:
            conn.close()
            raise ForkUnavailable(f"the fork server refused {argv[:4]}: {reply.get('error')}")
        return ForkedProcess(int(reply["pid"]), conn, rest)

    def _connect(self, conn: socket.socket) -> None:
        """Connect, waiting while the server has started but not bound its socket yet."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                conn.connect(self.socket_path)
                return
            except (FileNotFoundError, ConnectionRefusedError):
                if not self.server_alive() or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)


def _exists(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
