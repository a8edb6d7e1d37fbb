"""A private redis-server on a free port, for tests, ``rlbus redis`` and ``rlbus run`` without a URL.

    with LocalRedis() as server:      # or: url = LocalRedis(port=6390, dir=path).start()
        url = server.url
"""

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from bus.clients import sync_client
from bus.errors import RedisNotInstalledError, RlbusError

INSTALL_HINT = "apt-get install -y redis-server (macOS: brew install redis)"


def redis_server_argv(binary: str, port: int, dir: Path, aof: bool = True, password: str | None = None,
                      conf: Path | None = None) -> list[str]:
    """The redis-server command line of every private server: loopback only, data in ``dir``, no RDB snapshots,
    AUTH with ``password`` when given; ``conf``: a config file read first (one with ``requirepass`` keeps the
    password out of the command line, which ``ps`` shows)."""
    return [
        binary, *([str(conf)] if conf is not None else []),
        "--port", str(port), "--bind", "127.0.0.1", "--dir", str(dir),
        "--appendonly", "yes" if aof else "no", "--save", "", "--protected-mode", "no",
        "--daemonize", "no", "--loglevel", "warning", *(["--requirepass", password] if password else []),
    ]


def write_secret(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (mode 0600 from the start, never wider)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def redis_binary() -> str:
    """Path of redis-server; RedisNotInstalledError naming the install command when it is missing."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RedisNotInstalledError(f"redis-server is not on PATH; install it: {INSTALL_HINT}")
    return binary


def redis_answers(url: str, password: str | None = None) -> bool:
    """Whether the Redis at ``url`` answers PING right now."""
    try:
        with sync_client(url, socket_connect_timeout=0.5, password=password) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_free(host: str, port: int) -> bool:
    """Whether ``port`` on ``host`` can be bound now (a server about to start there would get it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            return True
        except OSError:
            return False


class LocalRedis:
    """One redis-server process bound to 127.0.0.1, data (AOF) in ``dir`` (a temp dir when None)."""

    def __init__(self, port: int | None = None, dir: Path | None = None, aof: bool = True, password: str | None = None):
        self.port = port
        self.dir = Path(dir) if dir is not None else None
        self.aof = aof
        self.password = password
        """AUTH password (``--requirepass``); None: none. ``url`` never contains it."""
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.port is None or self._proc is None:
            raise RlbusError("LocalRedis is not started; call start() first")
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> str:
        """Start redis-server and wait until it answers PING; returns its URL."""
        binary = redis_binary()
        if self.dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="rlbus-redis-")
            self.dir = Path(self._tmp.name)
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.port is None:
            self.port = free_port()
        args = [*redis_server_argv(binary, self.port, self.dir, self.aof, self.password),
                "--logfile", str(self.dir / "redis.log")]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_ready(timeout_s)
        return self.url

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not redis_answers(self.url, self.password):
            if self._proc.poll() is not None:
                log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RlbusError(
                    f"redis-server exited with code {self._proc.returncode} on port {self.port}; "
                    f"its log ({self.dir / 'redis.log'}):\n{log}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RlbusError(f"redis-server on port {self.port} did not answer PING within {timeout_s}s")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s) and remove its temp dir."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc is not None and self._proc.stderr is not None:
            self._proc.stderr.close()
        self._proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self.dir = None

    def wait(self) -> int:
        """Block until the server exits (``rlbus redis`` in the foreground); returns its exit code."""
        if self._proc is None:
            raise RlbusError("LocalRedis is not started; call start() first")
        return self._proc.wait()

    def __enter__(self) -> "LocalRedis":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
