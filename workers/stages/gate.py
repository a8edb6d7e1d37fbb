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

    Many groups of one worker wait on one gate and share one read: while one blocking read of the ``policy``
    stream (XREAD BLOCK through the tracker) is in flight, every waiter awaits that same read and re-checks when it
    returns. A waiter never queues behind the others' reads, so an eval group whose version is served passes at
    once however many training groups are held.
    """

    def __init__(self, tracker: PolicyTracker, max_off_policy_steps: int, prefetch_steps: int = 0,
                 block_ms: int = 1_000):
        self.tracker = tracker
        self.max_off_policy_steps = max_off_policy_steps
        self.prefetch_steps = prefetch_steps
        self.block_ms = block_ms
        self.packed = 0
        """The packer's last built step (``packer:last_step``) at the last refresh."""
        self._reading: asyncio.Task | None = None
        """The read of the policy stream in flight, shared by every waiter."""
        self._read_once = False
        """Whether a read has completed: until then the versions are unknown, not 0."""

    def is_open(self, eval_step: int | None = None) -> bool:
        """Whether a group would be admitted with the versions (and last packed step) seen so far."""
        return admits(self.tracker.served, self.tracker.trained, self.max_off_policy_steps, self.prefetch_steps,
                      eval_step, self.packed)

    async def wait(self, eval_step: int | None = None, stop: asyncio.Event | None = None) -> float:
        """Wait until admitted; returns seconds waited. Returns early (not admitted) once ``stop`` is set."""
        started = time.monotonic()
        if self._reading is None or not self._read_once:  # a blocking read in flight: decide on what it started from
            await self._read(block_ms=None)
        while not self.is_open(eval_step):
            if stop is not None and stop.is_set():
                break
            await self._read(block_ms=self.block_ms)
        return time.monotonic() - started

    async def _read(self, block_ms: int | None) -> None:
        """Join the read in flight, or start one (waiting up to ``block_ms`` for a policy event)."""
        if self._reading is None:
            self._reading = asyncio.create_task(self._refresh(block_ms))
        await asyncio.shield(self._reading)

    async def _refresh(self, block_ms: int | None) -> None:
        """New policy events (waiting up to ``block_ms`` for one), then the packer's last step."""
        try:
            await self.tracker.refresh(block_ms=block_ms)
            self.packed = int(await self.tracker.bus.state_get(LAST_STEP_FIELD) or 0)
            self._read_once = True
        finally:
            self._reading = None
