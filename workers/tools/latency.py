"""Where a sample's time goes, from the entry ids it got at each hop (task → rollout group → filtered group → batch
→ trained policy version), and the histograms the exporter keeps.

Every stream entry id starts with Redis's clock in ms when the entry was written, so the hops of a training task
``T`` are (a rollout group's ``timings["total_s"]`` splits its hop into waiting and working):

==========  ==================================================================================
queued      task entry → its rollout started (the group's entry − its ``total_s``)
generating  the rollout's ``total_s`` (staleness gate, sampling, env steps, scoring)
filtering   rollout group entry → its filtered group's entry (waiting for a filter, and filtering)
packing     filtered group entry → the entry of the step's micro-batch that holds it
training    that micro-batch's entry → the ``trained`` policy entry of its step
==========  ==================================================================================

A hop is observed as soon as both its ends are seen, so a follower that starts mid-run, or misses a trimmed entry,
still counts the hops it sees whole. Eval tasks are left out (their groups are never filtered, packed or trained).
"""

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from bus.messages import Task
from bus.views import BatchView, GroupView

HOPS = ("queued", "generating", "filtering", "packing", "training")
"""The hops of a training sample, in order."""

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
"""Upper bounds of the latency histograms' buckets (seconds)."""

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)
"""Upper bounds of the staleness histogram's buckets (steps a trained sample's policy is behind the trained one)."""

MAX_OPEN = 100_000
"""Hop starts remembered per kind; the oldest are forgotten past this (a hop whose other end never comes)."""


@dataclass
class Histogram:
    """Cumulative-bucket histogram in Prometheus's shape (``le`` bounds, ``+Inf`` last), with raw values kept for
    quantiles over a short window (``rlbus inspect --latency``)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    values: list[float] = field(default_factory=list)
    keep_values: bool = False

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        if self.keep_values:
            self.values.append(value)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, int]]:
        """``[(le, cumulative count), …, ("+Inf", count)]``."""
        running, out = 0, []
        for bound, n in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out

    def quantiles(self, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[float] | None:
        if not self.values:
            return None
        return [float(v) for v in np.quantile(np.asarray(self.values), qs)]


class _Bounded(OrderedDict):
    """A dict that forgets its oldest keys past :data:`MAX_OPEN`."""

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        while len(self) > MAX_OPEN:
            self.popitem(last=False)


class HopLatency:
    """Joins the entries of one run by task id and step into per-hop latency histograms and the staleness of
    what is trained. Feed it entries in each stream's order; streams may interleave in any order."""

    def __init__(self, keep_values: bool = False):
        self.hops = {hop: Histogram(LATENCY_BUCKETS_S, keep_values=keep_values) for hop in HOPS}
        self.staleness = Histogram(STALENESS_BUCKETS)
        self.last_staleness_max: int | None = None
        """The largest staleness among the samples of the last step whose micro-batches were read."""
        self._tasks: _Bounded = _Bounded()
        self._rollouts: _Bounded = _Bounded()
        self._filtered: _Bounded = _Bounded()
        self._batches: _Bounded = _Bounded()
        self._trained: _Bounded = _Bounded()

    def _observe(self, hop: str, start_ms: float, end_ms: float) -> None:
        self.hops[hop].observe(max(0.0, (end_ms - start_ms) / 1000))

    def task(self, at_ms: int, task: Task) -> None:
        if task.eval_step is None:
            self._tasks[task.task_id] = at_ms

    def rollout(self, at_ms: int, group: GroupView) -> None:
        if group.eval_step is not None:
            return
        total_s = float(group.timings.get("total_s", 0.0))
        self.hops["generating"].observe(total_s)
        issued = self._tasks.pop(group.task_id, None)
        if issued is not None:
            self._observe("queued", issued, at_ms - total_s * 1000)
        self._rollouts[group.task_id] = at_ms

    def filtered(self, at_ms: int, group: GroupView) -> None:
        rolled = self._rollouts.pop(group.task_id, None)
        if rolled is not None:
            self._observe("filtering", rolled, at_ms)
        self._filtered[group.task_id] = at_ms

    def batch(self, at_ms: int, mb: BatchView) -> None:
        """One micro-batch of step ``mb.step`` (call :meth:`step_done` after the step's last one)."""
        versions = mb.policy_versions.tolist()
        for task_id in dict.fromkeys(t for t in mb.task_ids if t):
            filtered = self._filtered.pop(task_id, None)
            if filtered is not None:
                self._observe("packing", filtered, at_ms)
        stale = [mb.step - 1 - v for t, v in zip(mb.task_ids, versions, strict=False) if t]
        for value in stale:
            self.staleness.observe(value)
        if stale:
            self.last_staleness_max = max(max(stale), self.last_staleness_max or 0)
        self._batches.setdefault(mb.step, at_ms)
        trained = self._trained.pop(mb.step, None)
        if trained is not None:  # the trained event came first (a follower that reads batches late)
            self._observe("training", at_ms, trained)

    def step_started(self) -> None:
        """A new step's micro-batches follow: the staleness maximum restarts."""
        self.last_staleness_max = None

    def trained(self, at_ms: int, step: int) -> None:
        packed = self._batches.pop(step, None)
        if packed is not None:
            self._observe("training", packed, at_ms)
        else:
            self._trained[step] = at_ms
