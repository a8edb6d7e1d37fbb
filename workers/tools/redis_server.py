"""``rlbus redis``: a private redis-server in the foreground for manual runs; prints its URL, stops on Ctrl-C."""

import argparse
from pathlib import Path

from bus.local_redis import LocalRedis
from workers.config import RlbusConfig


def main(config: RlbusConfig | None, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlbus redis", description="Run a local redis-server until Ctrl-C.")
    parser.add_argument("--port", type=int, default=6379, help="port to listen on (default 6379; 0 = a free port)")
    parser.add_argument("--dir", type=Path, default=None, help="data directory (AOF); default: a temp dir")
    parser.add_argument("--no-aof", action="store_true", help="turn append-only persistence off")
    args = parser.parse_args(argv)
    server = LocalRedis(port=args.port or None, dir=args.dir, aof=not args.no_aof)
    try:
        print(server.start(), flush=True)
        return server.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
