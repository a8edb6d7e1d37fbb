"""RL settings side by side on one job: what each does to the reward, the greedy eval and the entropy.

    python benchmarks/rl_settings.py [--config configs/default.toml] [--steps 600] [--seeds 0] [--only NAME ...]

Runs ``rlbus run`` once per setting and seed (one after another, so each has the cores to itself) and prints a
Markdown table: setting, seed, mean training reward of the last 50 steps (the packer's, over every sample),
greedy eval at the end (the config's eval envs), mean entropy of the last 50 steps, wall time.
"""

import argparse
import tempfile
from pathlib import Path

from rlbus_run import ROOT, rlbus_run

SETTINGS: dict[str, tuple[str, ...]] = {
    "as shipped": (),
    "zero-advantage samples kept in the loss normaliser": (
        "--packer.post_batch_filters",
        '[{type="gibberish"},{type="repetition"},{type="zero_advantage",enforce=false}]'),
    "std-normalised advantages": ("--filter.advantage.std_normalize", "true"),
    "higher upper clip (dppo_mask_high 0.4)": ("--trainer.loss.type", "dppo", "--trainer.loss.dppo_mask_high", "0.4"),
    "KL term x10 (kl_tau 1e-2)": ("--trainer.loss.type", "dppo", "--trainer.loss.kl_tau", "1e-2"),
    "no KL term (kl_tau 0)": ("--trainer.loss.type", "dppo", "--trainer.loss.kl_tau", "0"),
    "entropy bonus (entropy_coef 0.01)": ("--trainer.entropy_coef", "0.01"),
}
"""Setting → the overrides that make it (on top of the config)."""


def run(config: Path, out: Path, steps: int, seed: int, port: int, overrides: tuple[str, ...]) -> dict:
    done = rlbus_run(config, out, steps, port, "--run.seed", str(seed), "--eval.interval", str(steps), *overrides)
    summary, rows = done.summary, done.rows
    last = lambda key, source: [r[key] for r in rows if r["source"] == source and key in r  # noqa: E731
                                and r.get("step") is not None and r["step"] > steps - 50]
    rewards, entropy = last("packer/reward_mean", "packer"), last("entropy", "trainer")
    final = summary["eval"].get(str(steps), {})
    greedy = [v for k, v in final.items() if k.endswith("/reward")]
    return {"reward": sum(rewards) / max(len(rewards), 1), "greedy": greedy[0] if greedy else float("nan"),
            "entropy": sum(entropy) / max(len(entropy), 1), "wall_s": summary["wall_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "default.toml")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--only", nargs="+", choices=sorted(SETTINGS), help="run only these settings")
    parser.add_argument("--port", type=int, default=8780)
    args = parser.parse_args()
    print("| setting | seed | train reward, last 50 steps | greedy eval at the end | entropy, last 50 steps | wall |")
    print("|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory(prefix="rlbus-settings-") as tmp:
        for i, (name, overrides) in enumerate(SETTINGS.items()):
            if args.only and name not in args.only:
                continue
            for seed in args.seeds:
                r = run(args.config, Path(tmp) / f"s{i}_{seed}", args.steps, seed, args.port, overrides)
                print(f"| {name} | {seed} | {r['reward']:.3f} | {r['greedy']:.3f} | {r['entropy']:.2f} | "
                      f"{r['wall_s']:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
