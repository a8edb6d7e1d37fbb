"""Adaptive rollout concurrency against fixed settings, in one invocation, on the CPU default and with a slow env.

    python benchmarks/concurrency.py [--steps 60] [--rounds 2] [--fixed 8 16 32] [--bad 1] [--delay-s 0.2]

Runs ``rlbus run @ configs/default.toml`` (eval off) for ``--steps`` steps per setting, the settings alternating
within each round: each ``--fixed`` ``rollout.max_concurrent_groups``, the ``--bad`` one, and
``rollout.concurrency.adaptive`` (starting at the config's 16 groups). Then the same with the slow env
(:mod:`benchmarks.slow_env`: echo_chars whose score awaits ``--delay-s``). For each run it prints trained samples/s
over its steps alone (first to last packed step) and over the whole command; then, per job, the mean of each
setting and its ratio to the best fixed one; the last line per job is ``adaptive/best fixed: X``.
"""

import argparse
import re
import tempfile
from pathlib import Path
from statistics import mean

from rlbus_run import ROOT, rlbus_run

DEFAULT = ROOT / "configs" / "default.toml"
BATCH = 128
"""Samples a step of the CPU default (packer.batch_size)."""


def slow_config(tmp: Path, delay_s: float) -> Path:
    """The CPU default with its train env replaced by the slow one (same data, same reward)."""
    text = DEFAULT.read_text()
    text = text.replace('[[env]]\nid = "echo_chars"',
                        '[[env]]\nid = "benchmarks.slow_env:load_environment"\nname = "echo_chars"', 1)
    text = re.sub(r"args = \{ num_examples = 4096, answer_len = 4 \}",
                  f"args = {{ num_examples = 4096, answer_len = 4, delay_s = {delay_s} }}", text, count=1)
    path = tmp / "slow.toml"
    path.write_text(text)
    return path


def one_run(config: Path, out: Path, steps: int, port: int, overrides: tuple[str, ...]) -> tuple[float, float]:
    """Trained samples/s over the steps alone and over the whole command."""
    run = rlbus_run(config, out, steps, port, "--eval.env", "none", *overrides)
    at = sorted(r["at"] for r in run.rows if "packer/reward_mean" in r)
    steps_s = (len(at) - 1) * BATCH / (at[-1] - at[0])
    return steps_s, run.summary["steps_trained"] * BATCH / run.wall_s


def settings(fixed: list[int], bad: int) -> dict[str, tuple[str, ...]]:
    out = {f"fixed {n}": ("--rollout.max_concurrent_groups", str(n)) for n in [*fixed, bad]}
    out["adaptive"] = ("--rollout.concurrency.adaptive", "true")
    return out


def job(name: str, config: Path, tmp: Path, args) -> None:
    runs: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for label, overrides in settings(args.fixed, args.bad).items():
            out = tmp / f"{name}-{label.replace(' ', '')}-{round_}"
            steps_s, whole_s = one_run(config, out, args.steps, args.port, overrides)
            runs.setdefault(label, []).append(steps_s)
            print(f"{name} round {round_} {label:9s}: {steps_s:7.1f} samples/s over the steps, {whole_s:6.1f} whole "
                  "run", flush=True)
    best = max(mean(runs[f"fixed {n}"]) for n in args.fixed)
    for label, values in runs.items():
        print(f"{name} {label:9s}: mean {mean(values):7.1f} samples/s ({', '.join(f'{v:.1f}' for v in values)}), "
              f"{mean(values) / best:.2f}x best fixed")
    print(f"{name} adaptive/best fixed: {mean(runs['adaptive']) / best:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--fixed", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--bad", type=int, default=1)
    parser.add_argument("--delay-s", type=float, default=0.2, help="the slow env's wait per score call")
    parser.add_argument("--jobs", nargs="+", default=["default", "slow_env"], choices=["default", "slow_env"])
    parser.add_argument("--port", type=int, default=8760)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlbus-concurrency-") as tmp:
        configs = {"default": DEFAULT, "slow_env": slow_config(Path(tmp), args.delay_s)}
        for name in args.jobs:
            job(name, configs[name], Path(tmp), args)


if __name__ == "__main__":
    main()
