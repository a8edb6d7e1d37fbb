"""What a person watching a run sees: a live rich panel on a TTY (:func:`render`); otherwise the lines
of :mod:`workers.run.status_report`.

:class:`RunProbe` gathers a :class:`Snapshot` from Redis (policy versions, state counters,
``XINFO GROUPS`` lag and pending of every stream, dead letters) and from the metrics rows the
run has read.
"""

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from bus.keys import GROUP_EVAL, GROUP_FILTER, GROUP_PACKER, GROUP_ROLLOUT
from bus.policy import PolicyTracker
from bus.resp import as_str
from bus.streams import Bus
from workers.config import RlbusConfig


@dataclass
class StreamLag:
    name: str
    """Short stream name (``tasks:echo_chars``)."""
    group: str
    length: int
    lag: int | None
    """Entries not yet delivered to the group (None when Redis cannot tell)."""
    pending: int
    """Delivered, not yet acked."""


@dataclass
class Snapshot:
    trained: int = 0
    served_by: dict[str, int] = field(default_factory=dict)
    max_steps: int | None = None
    reward_train: float | None = None
    reward_eval: dict[str, float] = field(default_factory=dict)
    eval_step: int | None = None
    gen_tokens_per_s: float | None = None
    train_tokens_per_s: float | None = None
    step_s: float | None = None
    trainer_idle_s: float | None = None
    counters: dict[str, int] = field(default_factory=dict)
    dead: int = 0
    lags: list[StreamLag] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


class RunProbe:
    """Reads a run's live numbers from Redis and the metrics rows."""

    def __init__(self, config: RlbusConfig, bus: Bus):
        self.config = config
        self.bus = bus
        self.tracker = PolicyTracker(bus)
        self.latest: dict[str, dict[str, Any]] = {}
        """Source → the newest values it reported (with ``step``)."""
        self.generated: deque[tuple[float, float]] = deque()
        self.eval: dict[int, dict[str, float]] = {}
        self.sums: dict[str, float] = {}
        self._from_rollouts = False
        self.started = time.monotonic()

    def observe(self, row: dict[str, Any]) -> None:
        """Feed one metrics row (as the metrics writer wrote it)."""
        source = row["source"]
        if source == "eval" and row.get("step") is not None:
            self.eval.setdefault(int(row["step"]), {}).update({k: v for k, v in row.items() if k.startswith("eval/")})
        self.latest.setdefault(source, {}).update(row)
        for key in ("packer/groups", "packer/stale_groups", "filter/groups_dropped", "rollout/train_groups",
                    "filter/zero_advantage/dropped", "packer/filter/zero_advantage/dropped"):
            if key in row:
                self.sums[key] = self.sums.get(key, 0.0) + float(row[key])
        if source == "rollout" and "tokens_generated" in row:  # completion tokens of each group
            if not self._from_rollouts:
                self._from_rollouts = True
                self.generated.clear()
            self.generated.append((float(row["at"]), float(row["tokens_generated"])))
        elif source == "packer" and "packer/tokens" in row and not self._from_rollouts:
            self.generated.append((float(row["at"]), float(row["packer/tokens"])))

    def _gen_rate(self, window_s: float = 60.0) -> float | None:
        """Tokens generated per second over the last ``window_s`` (rollout reports; else what the packer took in)."""
        while len(self.generated) > 2 and self.generated[0][0] < time.time() - window_s:
            self.generated.popleft()
        if len(self.generated) < 2 or self.generated[-1][0] <= self.generated[0][0]:
            return None
        return sum(t for _, t in list(self.generated)[1:]) / (self.generated[-1][0] - self.generated[0][0])

    async def snapshot(self) -> Snapshot:
        await self.tracker.refresh()
        trainer, packer = self.latest.get("trainer", {}), self.latest.get("packer", {})
        last_eval = max(self.eval) if self.eval else None
        snap = Snapshot(
            trained=self.tracker.trained,
            served_by=dict(self.tracker.served_by),
            max_steps=self.config.run.max_steps,
            reward_train=packer.get("packer/reward_mean", trainer.get("reward_mean")),
            reward_eval={k.split("/", 1)[1]: v for k, v in self.eval.get(last_eval, {}).items()
                         if k.endswith("/reward") or k.endswith("/pass@1")},
            eval_step=last_eval,
            gen_tokens_per_s=self._gen_rate(),
            train_tokens_per_s=trainer.get("tokens_per_s"),
            step_s=trainer.get("step_time_s"),
            trainer_idle_s=trainer.get("wait_s"),
            counters=self.counters(),
            dead=await self.bus.length(self.bus.keys.dead()),
            lags=await self.stream_lags(),
            elapsed_s=time.monotonic() - self.started,
        )
        running = sum(lag.pending for lag in snap.lags if lag.group == "rollout")  # tasks a rollout worker holds
        snap.counters["rollouts_started"] = snap.counters["rollouts_finished"] + running
        return snap

    def counters(self) -> dict[str, int]:
        """Sums over the metrics seen so far: groups packed, dropped as stale and dropped by filters, rollouts
        finished (training groups) and zero-advantage samples dropped (either filter slot)."""
        s = self.sums
        return {"groups_packed": int(s.get("packer/groups", 0)), "groups_stale": int(s.get("packer/stale_groups", 0)),
                "groups_filtered": int(s.get("filter/groups_dropped", 0)),
                "rollouts_finished": int(s.get("rollout/train_groups", 0)),
                "samples_zero_variance": int(s.get("filter/zero_advantage/dropped", 0)
                                             + s.get("packer/filter/zero_advantage/dropped", 0))}

    async def stream_lags(self) -> list[StreamLag]:
        keys = self.bus.keys
        wanted: list[tuple[str, str]] = []
        for env in {e.resolved_name for e in self.config.env} | {e.resolved_name for e in self.config.eval.env}:
            wanted += [(keys.tasks(env), GROUP_ROLLOUT), (keys.rollouts(env), GROUP_FILTER),
                       (keys.rollouts(env), GROUP_EVAL), (keys.filtered(env), GROUP_PACKER)]
        out = []
        for stream, group in wanted:
            if not await self.bus.redis.exists(stream):
                continue
            length = await self.bus.length(stream)
            for info in await self.bus.groups(stream):
                name = as_str(info["name"])
                if name == group:
                    out.append(StreamLag(keys.family(stream) + ":" + keys.suffix(stream), group, length,
                                         info.get("lag"), int(info["pending"])))
        step = self.tracker.trained + 1
        out.append(StreamLag(f"batches:{step}", "trainer", await self.bus.length(keys.batches(step)), None, 0))
        return out


def fmt_num(value: float | None, fmt: str = "{:.3f}") -> str:
    return "—" if value is None else fmt.format(value)


def fmt_rate(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value / 1000:.1f}k" if value >= 1000 else f"{value:.0f}"


def render(snap: Snapshot, title: str) -> Panel:
    """The live panel."""
    total = snap.max_steps or max(snap.trained, 1)
    head = Table.grid(padding=(0, 2))
    head.add_row(
        Text(f"step {snap.trained}/{snap.max_steps or '∞'}", style="bold"),
        ProgressBar(total=total, completed=min(snap.trained, total), width=40),
        Text(f"{snap.elapsed_s:.0f}s"),
    )
    stats = Table.grid(padding=(0, 3))
    evals = "  ".join(f"{k} {v:.3f}" for k, v in snap.reward_eval.items()) or "—"
    c = snap.counters
    served = ", ".join(f"{k}={v}" for k, v in sorted(snap.served_by.items())) or "—"
    stats.add_row("reward (train)", fmt_num(snap.reward_train),
                  "eval" + (f" @{snap.eval_step}" if snap.eval_step is not None else ""), evals)
    stats.add_row("tokens/s rollouts", fmt_rate(snap.gen_tokens_per_s),
                  "tokens/s train", fmt_rate(snap.train_tokens_per_s))
    stats.add_row("step time", fmt_num(snap.step_s, "{:.2f}s"), "trainer idle", fmt_num(snap.trainer_idle_s, "{:.2f}s"))
    stats.add_row("groups packed", str(c.get("groups_packed", 0)),
                  "stale / filtered / errored",
                  f"{c.get('groups_stale', 0)} / {c.get('groups_filtered', 0)} / {snap.dead}")
    stats.add_row("policy trained", str(snap.trained), "served", served)
    lags = Table("stream", "group", "length", "lag", "pending", box=None, padding=(0, 2), header_style="dim")
    for lag in snap.lags:
        lags.add_row(lag.name, lag.group, str(lag.length), "—" if lag.lag is None else str(lag.lag), str(lag.pending))
    parts: list[Any] = [head, stats, lags]
    restarts = {k: v for k, v in snap.restarts.items() if v}
    if restarts:
        parts.append(Text("restarts: " + ", ".join(f"{k}×{v}" for k, v in sorted(restarts.items())), style="yellow"))
    parts += [Text(e, style="dim") for e in snap.events[-4:]]
    return Panel(Group(*parts), title=title, border_style="blue")
