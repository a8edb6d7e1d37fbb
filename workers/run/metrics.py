"""The ``metrics`` stream → ``output_dir/metrics.jsonl`` (and W&B when ``[wandb]`` is configured).

One JSON object per metrics entry: ``{"id", "source", "step", "at", **values}``. The file is
rewritten from the start of the stream when a writer starts, so a resumed run's file holds the
whole history once. W&B is imported only when configured; ``mode = "offline"`` writes under
``output_dir/wandb`` for a later ``wandb sync``.
"""

import json
from pathlib import Path
from typing import Any

from bus.messages import Metric
from workers.config import WandbConfig


class MetricsWriter:
    """Appends metrics to metrics.jsonl and W&B, and keeps them in memory for the summary and report."""

    def __init__(self, output_dir: Path, run_name: str, wandb_cfg: WandbConfig | None = None, config: dict | None = None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w")
        self.rows: list[dict[str, Any]] = []
        """Every row written, in stream order."""
        self._wandb = _start_wandb(wandb_cfg, run_name, Path(output_dir), config) if wandb_cfg else None

    def write(self, entry_id: str, metric: Metric) -> dict[str, Any]:
        row = {"id": entry_id, "source": metric.source, "step": metric.step, "at": metric.at, **metric.values}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self.rows.append(row)
        if self._wandb is not None:
            logged = {f"{metric.source}/{k}" if "/" not in k else k: v for k, v in metric.values.items()}
            if metric.step is not None:
                logged["step"] = metric.step
            self._wandb.log(logged)
        return row

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _start_wandb(cfg: WandbConfig, run_name: str, output_dir: Path, config: dict | None):
    try:
        import wandb
    except ImportError as e:
        raise ImportError("[wandb] is configured but wandb is not installed; pip install 'rlbus[wandb]'") from e
    run = wandb.init(
        project=cfg.project, name=cfg.name or run_name, mode=cfg.mode, dir=str(output_dir), config=config or {},
        resume="allow", id=run_name,
    )
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    return run
