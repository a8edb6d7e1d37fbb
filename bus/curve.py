"""CURVE keys of env servers on ``tcp://`` (ZeroMQ's CurveZMQ: encrypted, and only key holders are served).

A key folder holds two key pairs, each a Z85 text file: ``server.public``, ``server.secret``, ``client.public``,
``client.secret`` (the secrets mode 0600). A server loads the server pair and, through a ZAP handler, serves only a
client that proves it holds ``client.secret``; a client loads the client pair and checks the server against
``server.public``. :func:`generate` makes the folder once (``rlbus run``: ``OUTPUT_DIR/curve``); an env server
given ``--curve-dir`` and the run's rollout workers and feeder (``rollout.curve_dir``) read it.
"""

import os
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from bus.errors import ConfigError

PAIRS = ("server", "client")


def generate(folder: Path) -> Path:
    """Make the two key pairs in ``folder`` unless it has them (so servers started with them still match)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name in PAIRS:
        if (folder / f"{name}.secret").exists():
            continue
        public, secret = zmq.curve_keypair()
        fd = os.open(folder / f"{name}.secret", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
        (folder / f"{name}.public").write_bytes(public)
    return folder


def _key(folder: Path, file: str) -> bytes:
    try:
        key = (Path(folder) / file).read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"no CURVE key {file} in {folder} ({e}); point --curve-dir / rollout.curve_dir at the "
                          "folder `rlbus run` wrote (OUTPUT_DIR/curve)") from e
    if len(key) != 40:
        raise ConfigError(f"{Path(folder) / file} is not a Z85 CURVE key (40 characters, got {len(key)})")
    return key


class _ClientKey:
    """ZAP credentials check: only the folder's client key."""

    def __init__(self, key: bytes):
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key  # Z85, as pyzmq hands it over


def secure_server(socket: zmq.asyncio.Socket, folder: Path) -> Any:
    """Make ``socket`` (not yet bound) a CURVE server that serves only the folder's client; returns the ZAP
    authenticator to ``stop()`` with it (one per ZeroMQ context at a time: one CURVE server per process)."""
    auth = AsyncioAuthenticator(socket.context)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_ClientKey(_key(folder, "client.public")))
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, _key(folder, "server.public"))
    socket.setsockopt(zmq.CURVE_SECRETKEY, _key(folder, "server.secret"))
    return auth


def secure_client(socket: zmq.asyncio.Socket, folder: Path) -> None:
    """Make ``socket`` (not yet connected) a CURVE client of the folder's server."""
    socket.setsockopt(zmq.CURVE_PUBLICKEY, _key(folder, "client.public"))
    socket.setsockopt(zmq.CURVE_SECRETKEY, _key(folder, "client.secret"))
    socket.setsockopt(zmq.CURVE_SERVERKEY, _key(folder, "server.public"))
