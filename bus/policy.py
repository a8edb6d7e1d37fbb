"""Policy versions: ``trained`` (trainer) and ``served`` (each inference server) on the ``policy`` stream.

    tracker = PolicyTracker(bus)
    await tracker.refresh()
    await tracker.wait(lambda t: t.served >= next_step - max_off_policy_steps, timeout_s=30)
"""

import time
from collections.abc import Callable

from bus.messages import PolicyVersion
from bus.streams import Bus

_PAGE = 1000
"""Policy events read per XREAD; a full page means more may be waiting."""


async def publish_trained(bus: Bus, step: int) -> str:
    """Announce that step ``step``'s weights are written (trainer)."""
    return await bus.publish(bus.keys.policy(), PolicyVersion(role="trained", step=step))


async def publish_served(bus: Bus, server: str, step: int) -> str:
    """Announce that inference server ``server`` now serves the weights of step ``step``."""
    return await bus.publish(bus.keys.policy(), PolicyVersion(role="served", step=step, server=server))


class PolicyTracker:
    """Follows the ``policy`` stream from its start: newest trained step, each server's served step."""

    def __init__(self, bus: Bus):
        self.bus = bus
        self.trained = 0
        """Highest step the trainer has published (0 before any)."""
        self.served_by: dict[str, int] = {}
        """Each inference server's latest served step."""
        self._last_id = "0"

    @property
    def served(self) -> int:
        """The step every server serves at least (MIN over servers); 0 before any server reported."""
        return min(self.served_by.values(), default=0)

    async def refresh(self, block_ms: int | None = None) -> bool:
        """Read the policy events published since the last refresh; True when there were any.

        ``block_ms``: wait up to this long for the first new event (None: don't wait).
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
                return seen
            block_ms = None

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
