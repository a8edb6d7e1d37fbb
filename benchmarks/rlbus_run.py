"""One ``rlbus run`` as a benchmark step: the command line the benchmark scripts share, and what the run left."""

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class FinishedRun:
    summary: dict
    """``summary.json``."""
    rows: list[dict]
    """``metrics.jsonl``, in stream order."""
    wall_s: float
    """Seconds the whole command took, start-up included (the summary's ``wall_s`` counts from the run's start)."""


def rlbus_run(config: Path, out: Path, steps: int, port: int, *overrides: str) -> FinishedRun:
    """``rlbus run @ config`` for ``steps`` steps as run ``out.name`` in ``out`` on inference port ``port``, with
    ``overrides``; a run that fails ends the benchmark with its output."""
    argv = [sys.executable, "-m", "workers.cli", "run", "@", str(config), "--run.output_dir", str(out),
            "--run.name", out.name, "--run.max_steps", str(steps), "--inference.port", str(port), *overrides]
    started = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    wall_s = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"rlbus run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return FinishedRun(json.loads((out / "summary.json").read_text()), rows, wall_s)
