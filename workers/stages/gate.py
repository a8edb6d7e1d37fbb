"""The staleness gate: a rollout starts only while the served policy is recent enough.

Admission (ART's ``_wait_for_policy``, prime-rl's ``max_off_policy_steps``): with
``next_step = max(trained + 1 + prefetch, packed + 1)`` (the step the packer builds next: it runs up to
``prefetch`` steps ahead of the trainer, and once it has built that far — ``packed``, its
``packer:last_step`` — a group lands in the step after), a training group may start while
``served ≥ next_step − 1 − max_off_policy_steps``: step ``s`` trains policy ``s − 1`` and keeps
groups at most ``max_off_policy_steps`` versions behind it. Without ``packed`` a group started on the
version before ``trained`` while the packer is at its limit was sampled only to be dropped as stale (with vLLM,
whose reload takes ~0.1 s, 27% of the CPU default's groups). ``served`` is the oldest version any
inference server serves, so a group started now is still fresh enough for the step it will be
packed into. The packer re-checks when it builds a step (the guarantee: it drops groups older
than ``s − 1 − max_off_policy_steps``); the gate only keeps rollouts from running ahead.

Eval tasks carry ``eval_step``: they wait until every server serves at least that version and
are never held back as stale, however far training has moved on.
"""

import asyncio
import time

from bus.policy import PolicyTracker
from bus.state import LAST_STEP_FIELD


def admits(served: int, trained: int, max_off_policy_steps: int, prefetch_steps: int = 0,
           eval_step: int | None = None, packed: int = 0) -> bool:
    """Whether a group may start now (pure: served/trained versions and the last packed step in, decision out)."""
    if eval_step is not None:
        return served >= eval_step
    next_step = max(trained + 1 + prefetch_steps, packed + 1)
    return served >= next_step - 1 - max_off_policy_steps


class StalenessGate:
    """Blocks rollouts until :func:`admits` holds, reading ``policy`` events as they arrive.

    Many groups of one worker wait on one gate: a single waiter at a time blocks on the
    ``policy`` stream (XREAD BLOCK through the tracker); the others re-check when it wakes.
    """

    def __init__(self, tracker: PolicyTracker, max_off_policy_steps: int, prefetch_steps: int = 0,
                 block_ms: int = 1_000):
        self.tracker = tracker
        self.max_off_policy_steps = max_off_policy_steps
        self.prefetch_steps = prefetch_steps
        self.block_ms = block_ms
        self.packed = 0
        """The packer's last built step (``packer:last_step``) at the last refresh."""
        self._lock = asyncio.Lock()

    def is_open(self, eval_step: int | None = None) -> bool:
        """Whether a group would be admitted with the versions (and last packed step) seen so far."""
        return admits(self.tracker.served, self.tracker.trained, self.max_off_policy_steps, self.prefetch_steps,
                      eval_step, self.packed)

    async def wait(self, eval_step: int | None = None, stop: asyncio.Event | None = None) -> float:
        """Wait until admitted; returns seconds waited. Returns early (not admitted) once ``stop`` is set."""
        started = time.monotonic()
        async with self._lock:
            await self._refresh()
        while not self.is_open(eval_step):
            if stop is not None and stop.is_set():
                break
            async with self._lock:
                if not self.is_open(eval_step):
                    await self._refresh(block_ms=self.block_ms)
        return time.monotonic() - started

    async def _refresh(self, block_ms: int | None = None) -> None:
        """New policy events (waiting up to ``block_ms`` for one), then the packer's last step."""
        await self.tracker.refresh(block_ms=block_ms)
        self.packed = int(await self.tracker.bus.state_get(LAST_STEP_FIELD) or 0)
