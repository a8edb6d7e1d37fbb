"""A whole run against a peer: ``rlbus run`` and TRL's ``GRPOTrainer`` on the same job, alternating in one invocation.

    pip install -e '.[bench]'          # trl
    python benchmarks/peer.py [--steps 600] [--seeds 0 1] [--config configs/default.toml]

Both train the config's model (built by ``rlbus init-model``, the same random init), env, batch (prompts × group
size), group size, learning rate (constant), grad clip, completion length and temperature, for ``--steps``
optimizer steps, on CPU, per seed (the model's init and the run's seed). TRL runs strictly on-policy (one update per
generation batch, ``loss_type = "dapo"``, no KL, no std scaling: the closest to rlbus's default loss); rlbus runs as
configured (asynchronous). For each it prints the wall time, trained samples per second, the training reward per
window of steps and the held-out greedy reward at the end (the config's first eval env, scored the same way for both);
the last line is ``rlbus/trl samples-per-second ratio: X`` (the mean over seeds of each), after the mean held-out
greedy reward of each.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlbus_run import ROOT, rlbus_run

sys.path.insert(0, str(ROOT))

from workers.config import RlbusConfig  # noqa: E402
from workers.config_loader import load_config  # noqa: E402
from workers.envs.registry import load_env  # noqa: E402

WINDOWS = 4
"""Training reward is shown as the mean of this many equal windows of steps."""


def rlbus_job(config_path: Path, model_dir: Path, out: Path, steps: int, port: int, seed: int) -> dict:
    """One ``rlbus run``; its wall time, per-step rewards, and the greedy eval at the end."""
    run = rlbus_run(config_path, out, steps, port, "--model.path", str(model_dir), "--run.seed", str(seed),
                    "--eval.interval", str(steps), "--ckpt.interval", "none")
    summary, wall = run.summary, run.wall_s
    rewards = dict(sorted((r["step"], r["packer/reward_mean"]) for r in run.rows if "packer/reward_mean" in r))
    final = summary["eval"].get(str(steps), {})
    greedy = next((v for k, v in final.items() if k.endswith("/reward")), float("nan"))
    return {"wall_s": wall, "steps": summary["steps_trained"], "rewards": list(rewards.values()), "greedy": greedy}


def trl_job(config: RlbusConfig, model_dir: Path, out: Path, steps: int) -> dict:
    """TRL's GRPOTrainer on the same job, in this process (torch threads = the cores, as rlbus's children share
    them); wall time includes its start-up, as rlbus's does."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    started = time.monotonic()
    torch.set_num_threads(os.cpu_count() or 1)
    env_cfg = config.env[0]
    env = load_env(env_cfg.id, env_cfg.args)
    rows = [{"prompt": env.prompt(env.example(i)), "index": i} for i in range(len(env))]
    batch = config.batch_size()

    def reward(prompts, completions, index, **_):
        return [env.score(i, [*p, *c], {})["reward"] for p, c, i in zip(prompts, completions, index, strict=True)]

    args = GRPOConfig(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=batch, num_generations=env_cfg.group_size,
        max_completion_length=env_cfg.sampling.max_completion_tokens, temperature=env_cfg.sampling.temperature,
        learning_rate=config.trainer.lr, lr_scheduler_type="constant", max_grad_norm=config.trainer.max_grad_norm,
        adam_beta1=config.trainer.betas[0], adam_beta2=config.trainer.betas[1],
        weight_decay=config.trainer.weight_decay, beta=0.0, loss_type="dapo", scale_rewards="none",
        num_iterations=1, use_cpu=True, bf16=False, seed=config.run.seed, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows))
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    greedy = held_out_greedy(config, trainer.model, trainer.processing_class)
    return {"wall_s": time.monotonic() - started, "steps": trainer.state.global_step, "rewards": rewards,
            "greedy": greedy}


def held_out_greedy(config: RlbusConfig, model, tokenizer) -> float:
    """Mean reward of greedy answers on the config's first eval env (its num_examples), as rlbus's eval scores them."""
    import torch

    eval_cfg = config.eval.env[0]
    env = load_env(eval_cfg.id, eval_cfg.args)
    count = len(env) if eval_cfg.num_examples < 0 else min(eval_cfg.num_examples, len(env))
    max_new = config.eval_sampling(eval_cfg).max_completion_tokens or 16
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(count):
            prompt = env.prompt(env.example(i))
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
            new = model.generate(ids, do_sample=False, max_new_tokens=max_new, pad_token_id=tokenizer.pad_token_id)
            text = tokenizer.decode(new[0, ids.shape[1]:], skip_special_tokens=True)
            total += env.score(i, [*prompt, {"role": "assistant", "content": text}], {})["reward"]
    return total / count


def windows(rewards: list[float], n: int = WINDOWS) -> str:
    size = max(1, len(rewards) // n)
    parts = [rewards[i:i + size] for i in range(0, size * n, size) if rewards[i:i + size]]
    return " → ".join(f"{sum(p) / len(p):.3f}" for p in parts)


def trl_subprocess(config_path: Path, model_dir: Path, out: Path, steps: int, seed: int) -> dict:
    """:func:`trl_job` in a process of its own (as each rlbus run is), its result as JSON on the last line."""
    argv = [sys.executable, __file__, "--config", str(config_path), "--steps", str(steps), "--trl-job", str(out),
            "--model", str(model_dir), "--seeds", str(seed)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"TRL run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "default.toml")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--port", type=int, default=8760)
    parser.add_argument("--trl-job", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    config = load_config([args.config], [("run.seed", str(args.seeds[0]))])
    if args.trl_job:
        print(json.dumps(trl_job(config, args.model, args.trl_job, args.steps)))
        return
    speed: dict[str, list[float]] = {"rlbus": [], "trl": []}
    greedy: dict[str, list[float]] = {"rlbus": [], "trl": []}
    with tempfile.TemporaryDirectory(prefix="rlbus-peer-") as tmp:
        for seed in args.seeds:
            model_dir = Path(tmp) / f"model{seed}"
            subprocess.run([sys.executable, "-m", "workers.cli", "init-model", "--out", str(model_dir), "--preset",
                            config.model.init_preset or "tiny", "--seed", str(seed)], cwd=ROOT, check=True,
                           capture_output=True)
            for tool in ("rlbus", "trl"):
                out = Path(tmp) / f"{tool}{seed}"
                if tool == "rlbus":
                    result = rlbus_job(args.config, model_dir, out, args.steps, args.port, seed)
                else:
                    result = trl_subprocess(args.config, model_dir, out, args.steps, seed)
                per_s = result["steps"] * config.batch_size() / result["wall_s"]
                print(f"{tool:5s} seed {seed}: {result['steps']} steps in {result['wall_s']:.0f} s, "
                      f"{per_s:.1f} trained samples/s; "
                      f"train reward per {WINDOWS} windows {windows(result['rewards'])}; "
                      f"held-out greedy {result['greedy']:.3f}", flush=True)
                speed[tool].append(per_s)
                greedy[tool].append(result["greedy"])
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    print(f"held-out greedy, mean over seeds: rlbus {mean(greedy['rlbus']):.3f}, trl {mean(greedy['trl']):.3f}")
    print(f"rlbus/trl samples-per-second ratio: {mean(speed['rlbus']) / mean(speed['trl']):.2f}")

if __name__ == "__main__":
    main()
