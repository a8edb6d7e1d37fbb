"""The end of a run: ``summary.json`` (what happened, in numbers) and ``report.png`` (the curves).

Both are built from the rows of ``metrics.jsonl`` (see :mod:`workers.run.metrics`) plus the
group counts. Metric names: the packer's ``packer/reward_mean`` (every sample of the step's groups) and
``packer/groups``, ``packer/stale_groups`` and ``packer/tokens`` per step, the trainer's ``tokens_per_s``, the
eval's ``eval/{env}/…``.
"""

import json
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def series(rows: list[Row], key: str, source: str | None = None) -> dict[int, float]:
    """Step → value of ``key`` (the last report of each step wins), from rows that have a step."""
    out: dict[int, float] = {}
    for row in rows:
        if key in row and row.get("step") is not None and (source is None or row["source"] == source):
            out[int(row["step"])] = float(row[key])
    return dict(sorted(out.items()))


def train_reward(rows: list[Row]) -> dict[int, float]:
    """Mean reward per step of every sample of the step's groups (the policy's reward), as the packer reports it;
    the trainer's ``reward_mean`` is of the samples the post-batch filters kept (zero-advantage ones go), so it
    is not the policy's reward. Replays of batches alone have only the trainer's."""
    return series(rows, "packer/reward_mean", "packer") or series(rows, "reward_mean", "trainer")


def stale_fraction(rows: list[Row]) -> dict[int, float]:
    """Per step: groups dropped as stale / (groups packed + dropped)."""
    kept, stale = series(rows, "packer/groups", "packer"), series(rows, "packer/stale_groups", "packer")
    return {s: stale.get(s, 0.0) / (kept[s] + stale.get(s, 0.0)) for s in kept if kept[s] + stale.get(s, 0.0) > 0}


def rollout_tokens_per_s(rows: list[Row]) -> dict[int, float]:
    """Per step: tokens of the samples the packer put in the step / seconds since the previous step was packed."""
    packed = [(int(r["step"]), float(r["at"]), float(r["packer/tokens"])) for r in rows
              if r["source"] == "packer" and "packer/tokens" in r and r.get("step") is not None]
    packed.sort(key=lambda p: p[1])
    return {step: tokens / (at - prev_at)
            for (_, prev_at, _), (step, at, tokens) in zip(packed, packed[1:], strict=False) if at > prev_at}


def bench_numbers(rows: list[Row], warmup_steps: int = 1) -> dict[str, float]:
    """``bench = true``: means over the steps after the warm-up of step time, trainer and rollout tokens/s and
    trainer idle time (empty when no step was measured)."""
    measured = {s for s in series(rows, "step_time_s", "trainer") if s > warmup_steps}
    if not measured:
        return {}
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    out = {name: mean([v for s, v in series(rows, key, "trainer").items() if s in measured])
           for name, key in (("step_s", "step_time_s"), ("train_tokens_per_s", "tokens_per_s"),
                             ("trainer_idle_s", "wait_s"))}
    rollout = [v for s, v in rollout_tokens_per_s(rows).items() if s in measured]
    if rollout:
        out["rollout_tokens_per_s"] = mean(rollout)
    return {"steps": float(len(measured)), **out}


def eval_results(rows: list[Row]) -> dict[int, dict[str, float]]:
    """Eval step → its metrics (all eval envs merged)."""
    out: dict[int, dict[str, float]] = {}
    for row in rows:
        if row["source"] == "eval" and row.get("step") is not None:
            values = {k: v for k, v in row.items() if k.startswith("eval/")}
            out.setdefault(int(row["step"]), {}).update(values)
    return dict(sorted(out.items()))


def eval_curves(rows: list[Row], pass_at_1: bool) -> dict[str, dict[int, float]]:
    """Each eval reward (and pass@1 when asked) as step → value, by metric name."""
    evals = eval_results(rows)
    keys = {k for v in evals.values() for k in v if k.endswith("/reward") or (pass_at_1 and "/pass@1" in k)}
    return {key: {s: v[key] for s, v in evals.items() if key in v} for key in sorted(keys)}


def reward_points(rewards: dict[int, float]) -> dict[str, Any]:
    """First, last and best step of the training reward curve."""
    if not rewards:
        return {"first": None, "last": None, "best": None}
    first, last = min(rewards), max(rewards)
    best = max(rewards, key=lambda s: rewards[s])
    return {
        "first": {"step": first, "reward": rewards[first]},
        "last": {"step": last, "reward": rewards[last]},
        "best": {"step": best, "reward": rewards[best]},
    }


def build_summary(
    rows: list[Row], *, run: str, steps_trained: int, max_steps: int | None, wall_s: float,
    groups: dict[str, int], restarts: dict[str, int], stopped_because: str,
) -> dict[str, Any]:
    """Everything ``summary.json`` holds."""
    return {
        "run": run,
        "steps_trained": steps_trained,
        "max_steps": max_steps,
        "wall_s": round(wall_s, 1),
        "stopped_because": stopped_because,
        "reward": reward_points(train_reward(rows)),
        "eval": {str(step): values for step, values in eval_results(rows).items()},
        "groups": groups,
        "restarts": restarts,
    }


def write_summary(summary: dict[str, Any], output_dir: Path) -> Path:
    path = Path(output_dir) / "summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path


def moving_mean(values: list[float], window: int = 10) -> list[float]:
    """Each value replaced by the mean of it and the ``window - 1`` before it."""
    return [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
            for i in range(len(values))]


def pyplot():
    """matplotlib's ``pyplot`` on the Agg backend, imported on first use (~0.4 s; ``rlbus run`` does it while its
    workers start)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_report(rows: list[Row], output_dir: Path, title: str = "") -> Path:
    """``report.png``: training reward and eval curves, tokens/s, stale fraction, each against step."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.13, top=0.86, wspace=0.22)  # fixed: a layout engine costs 0.1 s
    ax = axes[0]
    rewards = train_reward(rows)
    ax.plot(list(rewards), list(rewards.values()), label="train reward", color="tab:blue", alpha=0.35)
    ax.plot(list(rewards), moving_mean(list(rewards.values())), label="train reward (mean of 10 steps)",
            color="tab:blue")
    for key, points in eval_curves(rows, pass_at_1=True).items():
        ax.plot(list(points), list(points.values()), "o-", label=key)
    ax.set(title="reward", xlabel="step")
    ax.legend(fontsize=8)
    ax = axes[1]
    for label, points in (("trainer tok/s", series(rows, "tokens_per_s", "trainer")),
                          ("rollout tok/s (packed)", rollout_tokens_per_s(rows))):
        ax.plot(list(points), list(points.values()), label=label)
    ax.set(title="throughput", xlabel="step", ylabel="tokens/s")
    ax.legend(fontsize=8)
    ax = axes[2]
    stale = stale_fraction(rows)
    ax.plot(list(stale), list(stale.values()), color="tab:red")
    ax.set(title="stale fraction (groups dropped / built)", xlabel="step", ylim=(-0.02, 1.02))
    if title:
        fig.suptitle(title)
    path = Path(output_dir) / "report.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def summary_text(summary: dict[str, Any], output_dir: Path) -> str:
    """The summary as the few lines ``rlbus run`` prints at the end."""
    r, g = summary["reward"], summary["groups"]
    fmt = lambda p: "—" if p is None else f"{p['reward']:.3f} (step {p['step']})"  # noqa: E731
    lines = [
        f"run {summary['run']}: {summary['steps_trained']} steps in {summary['wall_s']:.0f}s "
        f"({summary['stopped_because']})",
        f"  train reward  first {fmt(r['first'])}  last {fmt(r['last'])}  best {fmt(r['best'])}",
    ]
    for step, values in summary["eval"].items():
        shown = "  ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in values.items()
                          if k.endswith("/reward") or "/pass@" in k)
        lines.append(f"  eval @ step {step}: {shown}")
    lines.append(
        f"  groups: produced {g['produced']} = trained {g['trained']} + filtered {g['filtered']} + stale {g['stale']}"
        f" + dead-lettered {g['dead_lettered']} + in flight {g['in_flight']}"
        + (f" (unaccounted {g['unaccounted']})" if g["unaccounted"] else "")
    )
    restarts = {k: v for k, v in summary["restarts"].items() if v}
    lines.append(f"  restarts: {restarts or 'none'}")
    if summary.get("bench"):
        b = summary["bench"]
        lines.append(f"  bench ({b['steps']:.0f} steps after 1 warm-up): step {b['step_s']:.3f} s, train "
                     f"{b['train_tokens_per_s']:.0f} tok/s, rollouts {b.get('rollout_tokens_per_s', 0):.0f} tok/s, "
                     f"trainer idle {b['trainer_idle_s']:.3f} s")
    lines.append(f"  files: {output_dir / 'summary.json'}, {output_dir / 'metrics.jsonl'}, {output_dir / 'report.png'}")
    return "\n".join(lines)


def write_stages_report(stages: list[tuple[str, list[Row], bool]], output_dir: Path, title: str = "") -> Path:
    """``report.png`` of a chained run: each stage's eval rewards and (where the third item says so: not for sft on
    reference answers, which all score the same) its training reward, on one step axis (a stage's step 0 is where
    the previous one ended), stage boundaries dashed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 4), constrained_layout=True)
    offset = 0
    for i, (name, rows, show_train) in enumerate(stages):
        rewards = train_reward(rows)
        if show_train:
            ax.plot([offset + s for s in rewards], moving_mean(list(rewards.values())), color=f"C{i}",
                    label=f"{name}: train reward (mean of 10 steps)")
        for key, points in eval_curves(rows, pass_at_1=False).items():
            ax.plot([offset + s for s in points], list(points.values()), "o-", color=f"C{i}", alpha=0.6,
                    label=f"{name}: {key}")
        if i:
            ax.axvline(offset, color="grey", linestyle="--")
        ax.annotate(name, (offset, 1.0), xycoords=("data", "axes fraction"), xytext=(4, -12),
                    textcoords="offset points")
        offset += max(rewards, default=0)
    ax.set(title=title or "reward", xlabel="step (all stages)", ylabel="reward")
    ax.legend(fontsize=8)
    path = Path(output_dir) / "report.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def stages_text(summaries: list[dict[str, Any]], output_dir: Path) -> str:
    """The lines ``rlbus run`` prints after the last stage: per stage its steps, time and first → last eval."""
    lines = [f"{len(summaries)} stage(s):"]
    for s in summaries:
        evals = s["eval"]
        first, last = (evals[min(evals, key=int)], evals[max(evals, key=int)]) if evals else ({}, {})
        shown = "  ".join(f"{k.removeprefix('eval/')} {first[k]:.3f} → {last[k]:.3f}"
                          for k in first if k.endswith("/reward") and k in last)
        lines.append(f"  {s['stage']}: {s['steps_trained']} steps in {s['wall_s']:.0f}s ({s['stopped_because']})"
                     + (f"  {shown}" if shown else ""))
    lines.append(f"  files: {output_dir / 'summary.json'}, {output_dir / 'report.png'}")
    return "\n".join(lines)
