"""Soak: a long run of a small config; Redis's memory must stay flat once warm.

    python benchmarks/soak.py [--steps 2000] [--out DIR]

Runs ``rlbus run @ configs/default.toml`` with a small batch (its own private redis-server), samples Redis
``used_memory`` as training goes, and prints it at the start (first sample after warm-up), the middle and the
end. Consumed stream entries are trimmed and trained ``batches:*`` deleted behind checkpoints, so the end should
match the middle: the last line is ``soak end/middle used_memory ratio: X`` (1.0 = flat).
"""

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]


def resolved_url(out: Path, timeout_s: float = 120) -> str:
    """The Redis URL ``rlbus run`` wrote into its resolved config."""
    deadline = time.monotonic() + timeout_s
    path = out / "config.resolved.toml"
    while time.monotonic() < deadline:
        if path.exists():
            found = re.search(r'^url = "(.*)"', path.read_text(), flags=re.M)
            if found:
                return found.group(1)
        time.sleep(0.5)
    raise SystemExit(f"rlbus run wrote no {path} within {timeout_s:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="training steps (default 2000)")
    parser.add_argument("--warmup", type=int, default=100, help="steps before the first memory sample")
    parser.add_argument("--out", type=Path, default=None, help="output_dir (default: a temp dir)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="rlbus-soak-")) / "run"
    argv = [sys.executable, "-m", "workers.cli", "run", "@", str(ROOT / "configs" / "default.toml"),
            "--run.output_dir", str(out), "--run.max_steps", str(args.steps), "--packer.batch_size", "32",
            "--eval.env", "none", "--ckpt.interval", "50", "--ckpt.keep_last", "2"]
    out.mkdir(parents=True, exist_ok=True)
    log = open(out.parent / "soak.stdout", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    client = redis.Redis.from_url(resolved_url(out))
    samples: list[tuple[int, int]] = []  # (step, used_memory bytes)
    started = time.monotonic()
    while proc.poll() is None:
        try:
            step = int(client.hget("rlbus:{default}:state", "packer:last_step") or 0) - 1
            if step >= args.warmup and (not samples or step - samples[-1][0] >= 50):
                samples.append((step, int(client.info("memory")["used_memory"])))
        except redis.RedisError:
            pass  # the run is starting or stopping its redis-server
        time.sleep(1.0)
    wall_s = time.monotonic() - started
    if proc.returncode != 0 or len(samples) < 3:
        raise SystemExit(f"soak run failed (exit {proc.returncode}, {len(samples)} samples); see {log.name}")
    first, middle, end = samples[0], samples[len(samples) // 2], samples[-1]
    mb = lambda b: b / 2**20  # noqa: E731
    print(f"soak: {args.steps} steps in {wall_s:.0f}s, {len(samples)} memory samples from step {first[0]}")
    print(f"used_memory  start (step {first[0]}) {mb(first[1]):.2f} MiB   middle (step {middle[0]}) "
          f"{mb(middle[1]):.2f} MiB   end (step {end[0]}) {mb(end[1]):.2f} MiB   "
          f"max {mb(max(b for _, b in samples)):.2f} MiB")
    print(f"soak end/middle used_memory ratio: {end[1] / middle[1]:.2f}")


if __name__ == "__main__":
    main()
