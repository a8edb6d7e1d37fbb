"""Adaptive rollout concurrency: an AIMD controller of the groups one rollout worker keeps in flight.

``rollout.concurrency.adaptive``: every ``interval_s`` the worker reads the inference servers' load
(:mod:`workers.stages.server_load`) and :meth:`AimdController.update` moves its limit between ``floor`` and
``ceiling``:

- additive increase, +1 group, while the servers have headroom: nothing waits in their queues, their KV-cache
  (vLLM) or batch-slot (built-in) use is under ``use_threshold``, the latency per generated token is within half
  the cut margin of its recent best, and the worker fills its limit (a limit it does not use is not raised);
- multiplicative decrease, ×``decrease`` (at least -1), when a queue grows, a preemption happens or the latency
  per token passes ``latency_factor`` × its recent best;
- hold otherwise, and whenever no server answered (a missing signal never moves the limit).

The staleness gate bounds what runs regardless (a group waiting there holds no slot).
"""

import asyncio
from collections import deque
from collections.abc import Callable

from workers.concurrency_config import ConcurrencyConfig
from workers.stages.server_load import Load, ServerLoad


class AimdController:
    """The limit on groups in flight; :meth:`update` with each poll's load."""

    def __init__(self, cfg: ConcurrencyConfig, start: int, history: int = 30):
        self.cfg = cfg
        self.limit = min(max(start, cfg.floor), cfg.ceiling)
        self._waiting: int | None = None
        self._latencies: deque[float] = deque(maxlen=history)

    def update(self, load: Load | None, in_use: int) -> str | None:
        """Move the limit for ``load`` with ``in_use`` groups running; the reason when it changed, else None."""
        if load is None:
            return None  # no server answered: hold
        reason = self._cut_reason(load)
        if load.token_s is not None:
            self._latencies.append(load.token_s)
        if load.waiting is not None:
            self._waiting = load.waiting
        if reason is not None:
            new = max(self.cfg.floor, min(self.limit - 1, int(self.limit * self.cfg.decrease)))
        elif self._headroom(load) and in_use >= self.limit:
            new, reason = min(self.cfg.ceiling, self.limit + 1), "headroom"
        else:
            return None
        changed, self.limit = new != self.limit, new
        return reason if changed else None

    def _cut_reason(self, load: Load) -> str | None:
        if load.preemptions > 0:
            return "preemptions"
        if load.waiting and self._waiting is not None and load.waiting > self._waiting:
            return "queue_growing"
        if self._slower_than(load.token_s, self.cfg.latency_factor):
            return "latency"
        return None

    def _headroom(self, load: Load) -> bool:
        if load.waiting:
            return False
        if load.use is not None and load.use >= self.cfg.use_threshold:
            return False
        return not self._slower_than(load.token_s, 1 + (self.cfg.latency_factor - 1) / 2)

    def _slower_than(self, token_s: float | None, factor: float) -> bool:
        """Whether ``token_s`` is past ``factor`` × the best of the recent polls (never without a history)."""
        if token_s is None or not self._latencies:
            return False
        return token_s > factor * min(self._latencies)


async def adapt(controller: AimdController, servers: ServerLoad, peak_in_use: Callable[[], int], log) -> None:
    """Poll every ``interval_s`` and move the limit (logged as ``rollout_concurrency``); runs until cancelled.
    ``peak_in_use()`` gives the most groups that ran at once since its previous call."""
    interval = controller.cfg.interval_s
    while True:
        await asyncio.sleep(interval)
        try:
            load = await asyncio.wait_for(servers.poll(), timeout=interval)
        except TimeoutError:
            load = None
        reason = controller.update(load, peak_in_use())
        if reason is not None:
            log.info("rollout_concurrency", limit=controller.limit, reason=reason)
