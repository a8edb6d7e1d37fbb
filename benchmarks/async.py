"""The same job synchronous and asynchronous, in one invocation: what running off-policy buys on this box.

    python benchmarks/async.py [--steps 150] [--rounds 1] [--threshold 0.15]

Runs ``rlbus run @ configs/default.toml`` for ``--steps`` steps twice per round, alternating:

- **sync**: ``packer.max_off_policy_steps = 0`` — strictly on-policy (prefetching is then off too): the rollouts of
  step s start only once every server serves policy s − 1, so generation and training take turns;
- **async**: the config as it is (``max_off_policy_steps = 2``, one step prefetched).

For each it prints steps per minute over the run's own wall clock (start-up and shutdown included, the same few
seconds in both modes) and over its steps alone (first to last packed step), the wall-clock seconds until the
training reward's 10-step mean first reaches ``--threshold``, and the reward at the end. It then prints the
whole-run ratio; the last line is ``async/sync steps ratio: X`` over the steps alone (the best round of each).
"""

import argparse
import tempfile
from pathlib import Path

from rlbus_run import ROOT, rlbus_run


def run_job(out: Path, steps: int, port: int, *overrides: str) -> dict:
    """One ``rlbus run``; its wall time, steps and per-step (time, reward) from metrics.jsonl."""
    run = rlbus_run(ROOT / "configs" / "default.toml", out, steps, port, "--eval.env", "none", *overrides)
    packed = sorted((r["at"], r["step"], r["packer/reward_mean"]) for r in run.rows if "packer/reward_mean" in r)
    return {"wall_s": run.summary["wall_s"], "steps": run.summary["steps_trained"], "rewards": packed}


def steps_per_min(rewards: list[tuple[float, int, float]]) -> float:
    """Steps a minute between the first and the last packed step."""
    return (len(rewards) - 1) / (rewards[-1][0] - rewards[0][0]) * 60


def seconds_to(rewards: list[tuple[float, int, float]], threshold: float, window: int = 10) -> float | None:
    """Seconds from the first packed step until the mean reward of ``window`` consecutive steps reaches it."""
    for i in range(window, len(rewards) + 1):
        if sum(r for _, _, r in rewards[i - window:i]) / window >= threshold:
            return rewards[i - 1][0] - rewards[0][0]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threshold", type=float, default=0.15, help="reward for the time-to-reward figure")
    parser.add_argument("--port", type=int, default=8740)
    args = parser.parse_args()
    modes = {"sync": ("--packer.max_off_policy_steps", "0"), "async": ()}
    best_run: dict[str, float] = {}
    best_steps: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="rlbus-async-") as tmp:
        for round_ in range(args.rounds):
            for mode, overrides in modes.items():
                result = run_job(Path(tmp) / f"{mode}{round_}", args.steps, args.port, *overrides)
                per_min = result["steps"] / result["wall_s"] * 60
                steps_rate = steps_per_min(result["rewards"])
                reach = seconds_to(result["rewards"], args.threshold)
                tail = result["rewards"][-20:]
                print(f"{mode:5s} round {round_}: {result['steps']} steps in {result['wall_s']:.0f} s = "
                      f"{per_min:.0f} steps/min, {steps_rate:.0f} over the steps alone; reward {args.threshold} "
                      f"(10-step mean) after {'never' if reach is None else f'{reach:.0f} s'}; last 20 steps "
                      f"{sum(r for _, _, r in tail) / max(len(tail), 1):.3f}", flush=True)
                best_run[mode] = max(best_run.get(mode, 0.0), per_min)
                best_steps[mode] = max(best_steps.get(mode, 0.0), steps_rate)
    print(f"async/sync whole-run ratio: {best_run['async'] / best_run['sync']:.2f}")
    print(f"async/sync steps ratio: {best_steps['async'] / best_steps['sync']:.2f}")


if __name__ == "__main__":
    main()
