"""Follows a run's streams with plain XREADs (never a consumer group) and keeps what the exporter reports from them.

Input: the entries of ``metrics``, ``dead``, ``policy``, every ``tasks:*``, ``rollouts:*``, ``filtered:*`` and each
step's ``batches:{s}``, read after the last id it saw. Output: counters (groups produced / trained / filtered /
stale / dead, dead letters by reason, tokens, idle seconds), the newest values each source reported (rewards, eval
results, step time), policy versions trained and served, and the histograms of :mod:`workers.tools.latency` and of
the weight-update latency. Consumer-group streams are trimmed behind their consumers every few seconds, so a
follower reads with a blocking XREAD, so it sees an entry within milliseconds of its write; a hop it misses
(a follower started late, or stopped a while) is just not counted.
"""

import re
import threading
import time
from collections import defaultdict

import redis

from bus.errors import DecodeError
from bus.keys import Keys
from bus.messages import DeadLetter, Metric, PolicyVersion, Task, decode
from bus.observe import group_streams, id_ms, read_after, read_all
from bus.state import LAST_STEP_FIELD
from bus.views import BatchView, GroupView, decode_view
from workers.tools.latency import LATENCY_BUCKETS_S, Histogram, HopLatency

SUMMED = {
    "rollout/train_groups": ("groups", "produced"),
    "packer/groups": ("groups", "trained"),
    "filter/groups_dropped": ("groups", "filtered"),
    "packer/stale_groups": ("groups", "stale"),
    "packer/duplicate_groups": ("groups", "duplicate"),
    "tokens_generated": ("tokens", "generated"),
    "packer/tokens": ("tokens", "packed"),
    "tokens": ("tokens", "trained"),
    "wait_s": ("seconds", "trainer_idle"),
    "step_time_s": ("seconds", "trainer_step"),
    "wait_gate_s": ("seconds", "rollout_gate_wait"),
}
"""Metric value name → (counter, label) it adds to. ``tokens``/``wait_s``/``step_time_s`` come from the trainer."""

TRAINER_SOURCES = {"tokens", "wait_s", "step_time_s"}
"""Summed values that only the trainer's rows carry under these names."""

_REASON = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
GROUP_FAMILIES = ("tasks", "rollouts", "filtered")

READ_PAUSE_S = 0.25
"""After a read that found entries, a follower waits this long before the next, so that entries arrive in batches
instead of one wake-up (and a round of reads) each. Latencies come from entry ids, not from when they are read."""

DISCOVER_S = 5.0
"""How often the follower looks for the streams of envs it does not follow yet (a config that names none of them,
an exporter started with only ``--run.name``)."""


def reason_class(reason: str) -> str:
    """A dead letter's reason as a short label: its first word (``decode``, ``delivered``, ``TimeoutError``, …), so
    the label's values stay few."""
    match = _REASON.search(reason)
    return match.group(0) if match else "other"


class RunFollower:
    """What a run's streams said so far (see the module doc). Call :meth:`poll` in a loop."""

    def __init__(self, client: redis.Redis, run: str, envs: list[str], keep_values: bool = False):
        """Follow run ``run``'s streams of ``envs`` and of every env whose streams appear (looked for every
        :data:`DISCOVER_S`); ``keep_values`` keeps each hop's latencies (for quantiles)."""
        self.client = client
        self.keys = Keys(run)
        self.envs = sorted(envs)
        self.counters: dict[tuple[str, str], float] = defaultdict(float)
        self.dead: dict[tuple[str, str], int] = defaultdict(int)
        """(stream family, reason class) → dead letters."""
        self.latest: dict[str, dict[str, float]] = defaultdict(dict)
        """Source → the newest value of each name it reported."""
        self.eval: dict[str, dict[str, float]] = defaultdict(dict)
        """Eval env → its newest ``reward``, ``pass@1`` and ``step``."""
        self.trained = 0
        self.trained_at_ms: int | None = None
        self.served: dict[str, int] = {}
        self.latency = HopLatency(keep_values)
        self.weight_update = defaultdict(lambda: Histogram(LATENCY_BUCKETS_S))
        """Server → seconds from a step's ``trained`` entry to that server's ``served`` entry for it."""
        self._trained_ms: dict[int, int] = {}
        self._positions = {self.keys.metrics(): "0", self.keys.dead(): "0", self.keys.policy(): "0"}
        for env in self.envs:
            self._positions.update({self.keys.tasks(env): "0", self.keys.rollouts(env): "0",
                                    self.keys.filtered(env): "0"})
        self.next_step: int | None = None
        self._discovered_at = float("-inf")
        self.lock = threading.Lock()
        """Held while the figures change; a reader of them (a scrape) takes it too."""

    def poll(self, block_ms: int | None = None) -> int:
        """Read every new entry (waiting up to ``block_ms`` for the first); returns how many. Reads outside
        :attr:`lock`, counts under it."""
        if time.monotonic() - self._discovered_at >= DISCOVER_S:
            found = group_streams(self.client, self.keys)  # a task's hops are read in order: tasks, rollouts, filtered
            for key in sorted(found, key=lambda k: GROUP_FAMILIES.index(self.keys.family(k))):
                self._positions.setdefault(key, "0")
            self._discovered_at = time.monotonic()
        entries = read_after(self.client, self._positions, block_ms=block_ms)
        with self.lock:
            for stream, entry_id, fields in entries:
                self._entry(stream, entry_id, fields)
        return len(entries) + self._follow_batches()

    def _entry(self, stream: str, entry_id: str, fields: dict) -> None:
        family, at_ms = self.keys.family(stream), id_ms(entry_id)
        try:  # of a group, only what the hops need: its samples are the stages' to read
            message = decode_view(GroupView, fields) if family in ("rollouts", "filtered") else decode(fields)
        except DecodeError:
            return  # a stage dead-letters it; its dead letter is counted
        if isinstance(message, Metric):
            self._metric(message)
        elif isinstance(message, DeadLetter):
            self._dead(message)
        elif isinstance(message, PolicyVersion):
            self._policy(at_ms, message)
        elif isinstance(message, Task):
            self.latency.task(at_ms, message)
        elif isinstance(message, GroupView) and family == "rollouts":
            self.latency.rollout(at_ms, message)
        elif isinstance(message, GroupView):
            self.latency.filtered(at_ms, message)

    def _metric(self, metric: Metric) -> None:
        for name, value in metric.values.items():
            target = SUMMED.get(name)
            if target is not None and (name not in TRAINER_SOURCES or metric.source == "trainer"):
                self.counters[target] += value
            if metric.source == "eval" and name.count("/") == 2:
                _, env, what = name.split("/")
                self.eval[env][what] = value
                self.eval[env]["step"] = float(metric.step or 0)
        self.latest[metric.source].update(metric.values)

    def _dead(self, letter: DeadLetter) -> None:
        family = self.keys.family(letter.stream) if letter.stream.startswith(self.keys.prefix) else "other"
        self.dead[(family, reason_class(letter.reason))] += 1
        if family in GROUP_FAMILIES:
            self.counters[("groups", "dead")] += 1

    def _policy(self, at_ms: int, event: PolicyVersion) -> None:
        if event.role == "trained":
            self.trained = max(self.trained, event.step)
            self.trained_at_ms = at_ms
            self._trained_ms[event.step] = at_ms
            self.latency.trained(at_ms, event.step)
            for old in [s for s in self._trained_ms if s < event.step - 64]:
                del self._trained_ms[old]
            return
        self.served[event.server] = event.step
        trained_ms = self._trained_ms.get(event.step)
        if trained_ms is not None:
            self.weight_update[event.server].observe(max(0.0, (at_ms - trained_ms) / 1000))

    def _follow_batches(self) -> int:
        """Read each step's micro-batches once the packer has published them (one commit writes a whole step)."""
        if self.next_step is None:  # start at the first step not yet packed when the follower started
            last = self.client.hget(self.keys.state(), LAST_STEP_FIELD)
            self.next_step = int(last or 0) + 1
        read = 0
        while True:
            entries = read_all(self.client, self.keys.batches(self.next_step))
            if not entries:
                last = int(self.client.hget(self.keys.state(), LAST_STEP_FIELD) or 0)
                if last <= self.next_step:
                    return read
                self.next_step += 1  # deleted before it was read (the trainer keeps only the last few)
                continue
            with self.lock:
                self.latency.step_started()
                for entry_id, fields in entries:
                    try:
                        self.latency.batch(id_ms(entry_id), decode_view(BatchView, fields))
                    except DecodeError:
                        continue
            read += len(entries)
            self.next_step += 1
