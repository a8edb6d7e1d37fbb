"""Worker liveness: every worker process renews its heartbeat in the run's ``workers`` sorted set.

Member ``{worker}@{host}`` (the worker's consumer name and the host it runs on), score = Redis's own clock in ms,
so hosts need not agree on time. A worker renews it every ``redis.heartbeat_s`` from its event loop, so a
worker whose loop is wedged, or that cannot reach Redis, goes stale; one that stops cleanly leaves at once.
``rlbus health`` (a container's liveness probe) reads it::

    redis-cli ZRANGE rlbus:demo:workers 0 -1 WITHSCORES
"""

import asyncio
import contextlib
import socket
from dataclasses import dataclass

from redis.exceptions import RedisError

from bus.resp import as_str

STOP_TIMEOUT_S = 5.0
"""A stopping worker waits at most this long for its heartbeat to end and leave the set."""

WORKER_FORGET_S = 3600.0
"""Heartbeats older than this are removed (by any worker's next beat), so restarts do not grow the set forever."""

_BEAT_LUA = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
"""

_AGES_LUA = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local rows = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local out = {}
for i = 1, #rows, 2 do
  out[#out + 1] = rows[i]
  out[#out + 1] = tostring(now - tonumber(rows[i + 1]))
end
return out
"""


@dataclass(frozen=True)
class WorkerBeat:
    """One worker's last heartbeat."""

    worker: str
    """Consumer name (``rollout-host-1234``, ``trainer-0``, ``inference-0``, …)."""
    host: str
    """The host (container, pod) it runs on."""
    age_s: float
    """Seconds since its last heartbeat, by Redis's clock."""

    @property
    def role(self) -> str:
        """The role, from the consumer name's first dash-separated word."""
        return self.worker.split("-", 1)[0]


def member(worker: str, host: str | None = None) -> str:
    """The ``workers`` member of ``worker`` on ``host`` (default: this host)."""
    return f"{worker}@{host or socket.gethostname()}"


async def worker_beats(redis, key: str) -> list[WorkerBeat]:
    """Every heartbeat in the ``workers`` set ``key``, freshest first."""
    rows = await redis.eval(_AGES_LUA, 1, key)
    beats = []
    for name, age_ms in zip(rows[::2], rows[1::2], strict=True):
        worker, _, host = as_str(name).rpartition("@")
        beats.append(WorkerBeat(worker, host, int(as_str(age_ms)) / 1000))
    return sorted(beats, key=lambda b: b.age_s)


class WorkerHeartbeat:
    """Renews one worker's heartbeat until stopped (a background task of the worker's event loop)."""

    def __init__(self, redis, key: str, worker: str, every_s: float, log):
        self.redis = redis
        self.every_s = every_s
        self.key = key
        self.member = member(worker)
        self.log = log
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()

    async def beat(self) -> None:
        await self.redis.eval(_BEAT_LUA, 1, self.key, self.member, int(WORKER_FORGET_S * 1000))

    def start(self) -> None:
        self._task = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        while not self._stop.is_set():
            try:
                await self.beat()
            except (RedisError, OSError) as e:  # Redis away: the heartbeat goes stale, and the probe says so
                if not self._stop.is_set():
                    self.log.warning("heartbeat_failed", error=str(e))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.every_s)

    async def stop(self) -> None:
        """Stop renewing and leave the set at once (best effort: else its age says it is gone).

        The loop also ends on the stop flag: a cancellation that lands inside a Redis call can come back as a
        timeout error (redis-py), which the loop would otherwise take for Redis being away and go on."""
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await asyncio.wait_for(self.redis.zrem(self.key, self.member), STOP_TIMEOUT_S)
