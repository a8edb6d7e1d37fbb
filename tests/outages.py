"""A Redis outage for tests: the server stops, stays away, and comes back on its port from its append-only file."""

import time
from pathlib import Path

from bus.local_redis import LocalRedis


def redis_outage(server: LocalRedis, dir: Path, seconds: float) -> LocalRedis:
    """Stop ``server`` for ``seconds`` and start it again on its port from its AOF in ``dir`` (keys whose TTL ran
    out meanwhile, such as leases, are gone). Returns the restarted server, to stop at the end."""
    port = server.port
    server.stop()
    time.sleep(seconds)
    restarted = LocalRedis(port=port, dir=dir)
    restarted.start()
    return restarted
