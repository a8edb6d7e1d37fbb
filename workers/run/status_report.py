"""Off a terminal, ART's status reporter: a short line per step, and a full ``[status]`` block every
``status.log_interval_seconds`` with values smoothed by an exponentially weighted average
(``status.ewa_alpha``): rewards, throughput, step and idle time, and the counts of rollouts started,
finished, errored and queued, and of groups or samples discarded as stale, zero-variance or filtered.
"""

from dataclasses import dataclass, field

from workers.run.status import Snapshot, fmt_num, fmt_rate


@dataclass
class Ewa:
    """Exponentially weighted averages: ``v ← α·x + (1 − α)·v`` (the first value starts it)."""

    alpha: float
    values: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, value: float | None) -> None:
        if value is None:
            return
        old = self.values.get(name)
        self.values[name] = value if old is None else self.alpha * value + (1 - self.alpha) * old

    def get(self, name: str) -> float | None:
        return self.values.get(name)


class StatusReporter:
    """Turns snapshots into lines: :meth:`step_line` each step, :meth:`block` when :meth:`block_due`."""

    def __init__(self, interval_s: float, ewa_alpha: float):
        self.interval_s = interval_s
        self.ewa = Ewa(ewa_alpha)
        self._block_at: float | None = None

    def observe(self, snap: Snapshot) -> None:
        """Fold one step's snapshot into the averages."""
        for name in ("reward_train", "gen_tokens_per_s", "train_tokens_per_s", "step_s", "trainer_idle_s"):
            self.ewa.add(name, getattr(snap, name))

    def block_due(self, snap: Snapshot) -> bool:
        """True once every ``interval_s`` of the run's time (the first after one interval)."""
        if self._block_at is None:
            self._block_at = snap.elapsed_s + self.interval_s
        if snap.elapsed_s < self._block_at:
            return False
        self._block_at = snap.elapsed_s + self.interval_s
        return True

    def step_line(self, snap: Snapshot) -> str:
        """About a hundred characters: step, reward (raw and smoothed), throughput, discards."""
        c = snap.counters
        return (f"step {snap.trained}/{snap.max_steps or '∞'} reward={fmt_num(snap.reward_train)} "
                f"(ewa {fmt_num(self.ewa.get('reward_train'))}) step_s={fmt_num(snap.step_s, '{:.2f}')} "
                f"gen_tok_s={fmt_rate(snap.gen_tokens_per_s)} stale={c.get('groups_stale', 0)} "
                f"zero_var={c.get('samples_zero_variance', 0)} errored={snap.dead}")

    def block(self, snap: Snapshot) -> str:
        """The full status, several lines."""
        c, e = snap.counters, self.ewa
        evals = "  ".join(f"{k} {v:.3f}" for k, v in snap.reward_eval.items())
        queued = sum((lag.lag or 0) for lag in snap.lags if lag.group == "rollout")
        lags = " ".join(f"{lag.name}[{lag.group}]={lag.lag if lag.lag is not None else lag.length}+{lag.pending}"
                        for lag in snap.lags)
        served = ", ".join(f"{k}={v}" for k, v in sorted(snap.served_by.items())) or "—"
        return "\n".join([
            f"[status] step {snap.trained}/{snap.max_steps or '∞'} t={snap.elapsed_s:.0f}s",
            f"  reward      train {fmt_num(snap.reward_train)} (ewa {fmt_num(e.get('reward_train'))})"
            + (f"  eval @ step {snap.eval_step}: {evals}" if evals else ""),
            f"  rollouts    started {c.get('rollouts_started', 0)}  finished {c.get('rollouts_finished', 0)}  "
            f"errored {snap.dead}  queued {queued}",
            f"  discarded   stale groups {c.get('groups_stale', 0)}  zero-variance samples "
            f"{c.get('samples_zero_variance', 0)}  filtered groups {c.get('groups_filtered', 0)}",
            f"  throughput  rollouts {fmt_rate(e.get('gen_tokens_per_s'))} tok/s  train "
            f"{fmt_rate(e.get('train_tokens_per_s'))} tok/s  step {fmt_num(e.get('step_s'), '{:.2f}')} s  "
            f"trainer idle {fmt_num(e.get('trainer_idle_s'), '{:.2f}')} s (ewa)",
            f"  policy      trained {snap.trained}  served {served}",
            f"  lag         {lags}",
        ])
