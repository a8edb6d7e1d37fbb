"""``rlbus health @ cfg.toml [--role ROLE] [--max-age-s S] [--any-host]``: the workers' heartbeats.

With ``--role``, a liveness probe: exit 0 when a ``ROLE`` worker on this host (container, pod) renewed its heartbeat
(:mod:`bus.liveness`) in the last ``--max-age-s`` seconds, else exit 1 with the reason (also when Redis cannot be
reached). Without it, the table of every worker of the run and the age of its heartbeat.

    rlbus health @ configs/compose.toml --role rollout      # docker compose / Kubernetes liveness probe
    rlbus health @ run.toml                                 # who is alive
"""

import argparse
import asyncio
import socket
import sys

from redis.exceptions import RedisError

from bus.clients import async_client, close_async_client
from bus.config import redact, redis_password
from bus.errors import ConfigError
from bus.keys import Keys
from bus.liveness import WorkerBeat, worker_beats
from workers.config import RlbusConfig

MISSED_BEATS = 6
"""A heartbeat older than this many ``redis.heartbeat_s`` is unhealthy (``--max-age-s`` by default)."""


def verdict(beats: list[WorkerBeat], role: str, host: str | None, max_age_s: float) -> tuple[bool, str]:
    """(healthy, one line) for ``role``'s workers on ``host`` (None: any host)."""
    mine = [b for b in beats if b.role == role and (host is None or b.host == host)]
    where = "" if host is None else f" on {host}"
    if not mine:
        return False, f"no {role} worker{where} has a heartbeat (not started, or stopped)"
    freshest = mine[0]
    if freshest.age_s > max_age_s:
        return False, (f"{freshest.worker}{where}: last heartbeat {freshest.age_s:.1f}s ago > {max_age_s:g}s "
                       "(wedged, or cut off from Redis)")
    return True, f"{freshest.worker}{where}: heartbeat {freshest.age_s:.1f}s ago"


def table(beats: list[WorkerBeat]) -> str:
    lines = [f"{'worker':<40} {'host':<24} {'age_s':>8}"]
    lines += [f"{b.worker:<40} {b.host:<24} {b.age_s:>8.1f}" for b in beats]
    return "\n".join(lines)


async def read_beats(config: RlbusConfig) -> list[WorkerBeat]:
    client = async_client(config.redis.url, decode_responses=False, password=redis_password(config.redis),
                          socket_timeout=5, socket_connect_timeout=5)
    try:
        return await worker_beats(client, Keys(config.run.name).workers())
    finally:
        await close_async_client(client)


def main(config: RlbusConfig, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlbus health", description=__doc__.split("\n")[0])
    parser.add_argument("--role", help="probe one role (feeder, rollout, filter, packer, trainer, inference)")
    parser.add_argument("--max-age-s", type=float, default=MISSED_BEATS * config.redis.heartbeat_s,
                        help=f"oldest healthy heartbeat, seconds (default {MISSED_BEATS} x redis.heartbeat_s)")
    parser.add_argument("--any-host", action="store_true", help="a worker of the role on any host will do")
    args = parser.parse_args(argv)
    if not config.redis.url:
        raise ConfigError("redis.url is unset; pass --redis.url redis://HOST:PORT/0 (the run's Redis)")
    try:
        beats = asyncio.run(read_beats(config))
    except (RedisError, OSError) as e:
        print(f"rlbus health: cannot read heartbeats from {redact(config.redis.url)}: {e}", file=sys.stderr)
        return 1
    if args.role is None:
        print(table(beats))
        return 0
    healthy, line = verdict(beats, args.role, None if args.any_host else socket.gethostname(), args.max_age_s)
    print(f"rlbus health: {line}", file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1
