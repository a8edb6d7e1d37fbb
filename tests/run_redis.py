"""The Redis of a finished or running ``rlbus run``, for tests that look inside it."""

import re
from pathlib import Path


def run_redis_url(out: Path) -> str:
    """The URL of the Redis of the run in ``out``, with the password of its private redis-server (in
    ``redis/password``) in the user part, so ``redis.Redis.from_url`` and ``--redis-url`` take it."""
    resolved = (out / "config.resolved.toml").read_text()
    url = re.search(r'^url = "(.+)"$', resolved, flags=re.M).group(1)
    file = re.search(r'^password_file = "(.+)"$', resolved, flags=re.M)
    if file is None:
        return url
    password = Path(file.group(1)).read_text().splitlines()[0]
    return url.replace("redis://", f"redis://:{password}@", 1)
