"""Whole runs against a peer: ``rlbus run`` and TRL's ``GRPOTrainer`` on the same jobs, alternating in one invocation.

    pip install -e '.[bench]'          # trl
    python benchmarks/peer.py [--jobs default quickstart-rl guess-number] [--seeds 0 1] [--steps N]

Three jobs, each from an rlbus config (its ``run.max_steps`` optimizer steps unless ``--steps``):

- ``default``: ``configs/default.toml`` (echo_chars, single turn) from the random init.
- ``quickstart-rl``: the RL stage of ``configs/quickstart.toml`` (reasoning-gym's spell_backward, single turn),
  both trainers starting from the weights of its SFT stage (run once per seed by ``rlbus run``, not timed).
- ``guess-number``: ``configs/guess_number.toml`` (multi-turn: hints between guesses, the env's tokens masked out
  of the loss; TRL through its multi-turn rollout interface, ``rollout_func`` with ``env_mask``).

Both train the job's model, env, batch (prompts × group size), group size, learning rate (constant), grad clip,
completion length and temperature, on CPU, per seed (the model's init and the run's seed). TRL runs strictly
on-policy (one update per generation batch, ``loss_type = "dapo"``, no KL, no std scaling: the closest to rlbus's
default loss; truncated answers masked where the job's filters drop them); rlbus runs as configured (asynchronous).
Each run is its own process, timed from start to exit (imports, start-up and the one held-out eval at the end
included; rlbus skips its step-0 eval, as TRL has none). For each it prints the wall time, trained samples per
second, the training reward per window of steps and the held-out greedy reward at the end (the job's first eval
env, scored the same way for both); then per job the mean over seeds; the last line is ``rlbus/trl
samples-per-second ratio:`` each job's and the lowest.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from rlbus_run import ROOT, rlbus_run

sys.path.insert(0, str(ROOT))

from peer_trl import trl_job  # noqa: E402

from workers.config import RlbusConfig  # noqa: E402
from workers.config_loader import load_config  # noqa: E402
from workers.run.resolved import dump_toml  # noqa: E402

WINDOWS = 4
"""Training reward is shown as the mean of this many equal windows of steps."""

JOBS = ("default", "quickstart-rl", "guess-number")


@dataclass
class Job:
    """One job both trainers run."""

    name: str
    config_path: Path
    """A config without ``[[stage]]``s: what ``rlbus run`` and the TRL process read."""
    steps: int
    from_sft: Path | None = None
    """A config whose run makes the starting weights (the quickstart's SFT stage); None: the random init."""

    @cached_property
    def config(self) -> RlbusConfig:
        return load_config([self.config_path])


def write_config(config: RlbusConfig, path: Path) -> Path:
    path.write_text(dump_toml(config.model_dump(mode="json", exclude_unset=True)))
    return path


def make_jobs(names: list[str], tmp: Path, steps: int | None) -> list[Job]:
    jobs = []
    for name in names:
        if name == "quickstart-rl":
            stages = {s.name: s.config for s in load_config([ROOT / "configs" / "quickstart.toml"]).stage}
            path = write_config(stages["rl"], tmp / "quickstart-rl.toml")
            jobs.append(Job(name, path, steps or stages["rl"].run.max_steps,
                            from_sft=write_config(stages["sft"], tmp / "quickstart-sft.toml")))
        else:
            path = ROOT / "configs" / ("default.toml" if name == "default" else "guess_number.toml")
            jobs.append(Job(name, path, steps or load_config([path]).run.max_steps))
    return jobs


def starting_weights(job: Job, tmp: Path, seed: int, port: int) -> Path:
    """The random init of the job's preset for ``seed`` (``rlbus init-model``), trained by ``job.from_sft`` if it
    has one."""
    config = job.config
    model_dir = tmp / f"model-{config.model.init_preset or 'tiny'}-{seed}"
    if not model_dir.exists():
        subprocess.run([sys.executable, "-m", "workers.cli", "init-model", "--out", str(model_dir), "--preset",
                        config.model.init_preset or "tiny", "--seed", str(seed)], cwd=ROOT, check=True,
                       capture_output=True)
    if job.from_sft is None:
        return model_dir
    sft = load_config([job.from_sft])
    out = tmp / f"{job.name}-sft{seed}"
    rlbus_run(job.from_sft, out, sft.run.max_steps, port, "--model.path", str(model_dir), "--run.seed", str(seed),
              "--ckpt.interval", "none")
    return out / "weights" / f"step_{sft.run.max_steps}"


def rlbus_job(config_path: Path, model_dir: Path, out: Path, steps: int, port: int, seed: int) -> dict:
    """One ``rlbus run``; its wall time, per-step rewards, and the greedy eval at the end."""
    run = rlbus_run(config_path, out, steps, port, "--model.path", str(model_dir), "--run.seed", str(seed),
                    "--eval.interval", str(steps), "--eval.skip_first_step", "true",
                    "--eval.sampling.temperature", "0.0", "--ckpt.interval", "none")
    summary, wall = run.summary, run.wall_s
    rewards = dict(sorted((r["step"], r["packer/reward_mean"]) for r in run.rows if "packer/reward_mean" in r))
    final = summary["eval"].get(str(steps), {})
    greedy = next((v for k, v in final.items() if k.endswith("/reward")), float("nan"))
    return {"wall_s": wall, "steps": summary["steps_trained"], "rewards": list(rewards.values()), "greedy": greedy}


def windows(rewards: list[float], n: int = WINDOWS) -> str:
    size = max(1, len(rewards) // n)
    parts = [rewards[i:i + size] for i in range(0, size * n, size) if rewards[i:i + size]]
    return " → ".join(f"{sum(p) / len(p):.3f}" for p in parts)


def trl_subprocess(config_path: Path, model_dir: Path, out: Path, steps: int, seed: int) -> dict:
    """:func:`peer_trl.trl_job` in a process of its own, its result as JSON on the last line; timed from start to
    exit, imports included, as each ``rlbus run`` is."""
    argv = [sys.executable, __file__, "--trl-job", str(out), "--config", str(config_path), "--steps", str(steps),
            "--model", str(model_dir), "--seeds", str(seed)]
    started = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    wall_s = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"TRL run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": wall_s}


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def run_job(job: Job, seeds: list[int], tmp: Path, port: int) -> float:
    """Both trainers on ``job`` per seed, alternating; prints each run and the job's means; returns the
    samples/s ratio."""
    speed: dict[str, list[float]] = {"rlbus": [], "trl": []}
    greedy: dict[str, list[float]] = {"rlbus": [], "trl": []}
    batch = job.config.batch_size()
    for seed in seeds:
        model_dir = starting_weights(job, tmp, seed, port)
        for tool in ("rlbus", "trl"):
            out = tmp / f"{job.name}-{tool}{seed}"
            if tool == "rlbus":
                result = rlbus_job(job.config_path, model_dir, out, job.steps, port, seed)
            else:
                result = trl_subprocess(job.config_path, model_dir, out, job.steps, seed)
            per_s = result["steps"] * batch / result["wall_s"]
            print(f"{job.name} {tool:5s} seed {seed}: {result['steps']} steps in {result['wall_s']:.0f} s, "
                  f"{per_s:.1f} trained samples/s; train reward per {WINDOWS} windows {windows(result['rewards'])}; "
                  f"held-out greedy {result['greedy']:.3f}", flush=True)
            speed[tool].append(per_s)
            greedy[tool].append(result["greedy"])
    ratio = mean(speed["rlbus"]) / mean(speed["trl"])
    print(f"{job.name}: {job.steps} steps, held-out greedy (mean over seeds) rlbus {mean(greedy['rlbus']):.3f}, "
          f"trl {mean(greedy['trl']):.3f}; rlbus/trl samples-per-second ratio {ratio:.2f}", flush=True)
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", nargs="+", choices=JOBS, default=list(JOBS))
    parser.add_argument("--steps", type=int, help="optimizer steps of every job (default: each job's max_steps)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--port", type=int, default=8760)
    parser.add_argument("--trl-job", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_job:
        config = load_config([args.config], [("run.seed", str(args.seeds[0]))])
        print(json.dumps(trl_job(config, args.model, args.trl_job, args.steps)))
        return
    with tempfile.TemporaryDirectory(prefix="rlbus-peer-") as tmp:
        ratios = {job.name: run_job(job, args.seeds, Path(tmp), args.port)
                  for job in make_jobs(args.jobs, Path(tmp), args.steps)}
    each = ", ".join(f"{name} {ratio:.2f}" for name, ratio in ratios.items())
    print(f"rlbus/trl samples-per-second ratio: {each} (lowest {min(ratios.values()):.2f})")


if __name__ == "__main__":
    main()
