"""Policy versions: ``trained`` (trainer) and ``served`` (each inference server) on the ``policy`` stream.

Only live servers count toward ``served``: each running server renews its heartbeat in the ``servers``
sorted set every :data:`HEARTBEAT_S` (scored with Redis's own clock, so hosts need not agree on time);
one silent for :data:`SERVER_TTL_S` — scaled down, killed, partitioned — no longer pins ``served``.

    tracker = PolicyTracker(bus)
    await tracker.refresh()
    await tracker.wait(lambda t: t.served >= next_step - max_off_policy_steps, timeout_s=30)
"""

import contextlib
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from bus.messages import PolicyVersion
from bus.resp import as_str
from bus.streams import Bus

SERVER_TTL_S = 15.0
"""A server whose last heartbeat is older than this no longer counts toward ``served``."""

HEARTBEAT_S = 3.0
"""How often a running inference server renews its heartbeat (well inside :data:`SERVER_TTL_S`)."""

_HEARTBEAT_LUA = """
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], t[1] * 1000 + math.floor(t[2] / 1000), ARGV[1])
"""

_LIVE_LUA = """
local t = redis.call('TIME')
return redis.call('ZRANGEBYSCORE', KEYS[1], t[1] * 1000 + math.floor(t[2] / 1000) - tonumber(ARGV[1]), '+inf')
"""

LIVE_CACHE_S = 1.0
"""A tracker re-reads the live-server set at most this often (also every refresh that brought new events, and at
most a fifth of the server TTL), so frequent refreshes cost one XREAD, not an XREAD and a script."""

_PAGE = 1000
"""Policy events read per XREAD; a full page means more may be waiting."""


async def publish_served(bus: Bus, server: str, step: int) -> str:
    """Announce that inference server ``server`` now serves the weights of step ``step`` (a heartbeat too)."""
    await heartbeat(bus, server)
    return await bus.publish(bus.keys.policy(), PolicyVersion(role="served", step=step, server=server))


async def heartbeat(bus: Bus, server: str) -> None:
    """Mark ``server`` alive now."""
    await bus.redis.eval(_HEARTBEAT_LUA, 1, bus.keys.servers(), server)


async def server_stopped(bus: Bus, server: str) -> None:
    """A server that stops cleanly leaves at once instead of after its TTL (best effort: else the TTL does it)."""
    with contextlib.suppress(RedisError, OSError):
        await bus.redis.zrem(bus.keys.servers(), server)


class PolicyTracker:
    """Follows the ``policy`` stream from its start: newest trained step, each server's served step."""

    def __init__(self, bus: Bus, server_ttl_s: float = SERVER_TTL_S):
        self.bus = bus
        self.server_ttl_s = server_ttl_s
        self.trained = 0
        """Highest step the trainer has published (0 before any)."""
        self.served_by: dict[str, int] = {}
        """Each inference server's latest served step (live or not)."""
        self.live: set[str] = set()
        """Servers whose heartbeat is younger than ``server_ttl_s`` at the last refresh."""
        self._last_id = "0"
        self._live_at = float("-inf")
        self._live_every_s = min(LIVE_CACHE_S, server_ttl_s / 5)

    @property
    def served(self) -> int:
        """The step every live server serves at least (MIN over live servers); 0 while none is live."""
        return min((step for server, step in self.served_by.items() if server in self.live), default=0)

    async def refresh(self, block_ms: int | None = None, live: bool = True) -> bool:
        """Read the policy events published since the last refresh; True when there were any.

        ``block_ms``: wait up to this long for the first new event (None: don't wait); ``live``: also find which
        servers are live (:attr:`live`), after new events or once it is out of date.
        """
        seen = False
        while True:
            events = await self.bus.read_fanout(self.bus.keys.policy(), self._last_id, count=_PAGE, block_ms=block_ms)
            for entry_id, event in events:
                self._last_id = entry_id
                if not isinstance(event, PolicyVersion):
                    continue
                if event.role == "trained":
                    self.trained = max(self.trained, event.step)
                else:
                    self.served_by[event.server] = event.step
            seen = seen or bool(events)
            if len(events) < _PAGE:
                if live and (seen or time.monotonic() - self._live_at >= self._live_every_s):
                    await self._refresh_live()
                return seen
            block_ms = None

    async def _refresh_live(self) -> None:
        live = await self.bus.redis.eval(_LIVE_LUA, 1, self.bus.keys.servers(), int(self.server_ttl_s * 1000))
        self.live = {as_str(server) for server in live}
        self._live_at = time.monotonic()

    async def wait(self, predicate: Callable[["PolicyTracker"], bool], timeout_s: float | None = None) -> None:
        """Block (XREAD BLOCK) until ``predicate(self)`` holds; TimeoutError after ``timeout_s`` (None: forever)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        await self.refresh()
        while not predicate(self):
            block_ms = self.bus.cfg.block_ms
            if deadline is not None:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0:
                    raise TimeoutError(
                        f"policy condition not met within {timeout_s}s (trained={self.trained}, "
                        f"served_by={self.served_by})"
                    )
                block_ms = max(1, min(block_ms, left_ms))
            await self.refresh(block_ms=block_ms)
