"""The ``metrics`` stream → ``output_dir/metrics.jsonl`` (and W&B when ``[wandb]`` is configured).

One JSON object per metrics entry: ``{"id", "source", "step", "at", **values}``. A resumed run (or a restarted
``--attach``) keeps the rows the file has and goes on after its last entry id, so the file holds the whole history
once even when ``redis.maxlen`` has trimmed the stream's start (a fresh run starts without the file). W&B is
imported only when configured; ``mode = "offline"`` writes under ``output_dir/wandb`` for a later ``wandb sync``. A
resumed run continues the same W&B run (its id, in ``wandb/run-id``) and logs only the entries after the last one it
logged before (``wandb/logged-through`` keeps that id), so no row reaches W&B twice; ``report.png`` is logged at the
end.
"""

import json
import uuid
from pathlib import Path
from typing import Any

from bus.messages import Metric
from workers.config import RlbusConfig
from workers.monitor_config import WandbConfig

HIDDEN_ARGS = {"args"}
"""Env fields never sent to W&B: an env's factory arguments may hold secrets (a remote env's API key)."""


class MetricsWriter:
    """Appends metrics to metrics.jsonl and W&B, and keeps them in memory for the summary and report."""

    def __init__(self, output_dir: Path, run_name: str, wandb_cfg: WandbConfig | None = None,
                 config: dict | None = None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = read_rows(self.path)
        """Every row of the file, in stream order: those of an earlier session of the run, then this one's."""
        self._file = open(self.path, "w")
        self._file.writelines(json.dumps(row) + "\n" for row in self.rows)  # without a torn last line
        self._file.flush()
        self.last_id = self.rows[-1]["id"] if self.rows else "0"
        """The last entry in the file: this session reads the stream after it."""
        self._wandb = _start_wandb(wandb_cfg, run_name, Path(output_dir), config) if wandb_cfg else None
        self._logged_path = Path(output_dir) / "wandb" / "logged-through"
        self._logged_through = _entry_key(self._logged_path.read_text()) if self._logged_path.exists() else (-1, -1)

    def write(self, entry_id: str, metric: Metric) -> dict[str, Any]:
        row = {"id": entry_id, "source": metric.source, "step": metric.step, "at": metric.at, **metric.values}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self.rows.append(row)
        if self._wandb is not None and _entry_key(entry_id) > self._logged_through:
            logged = {f"{metric.source}/{k}" if "/" not in k else k: v for k, v in metric.values.items()}
            if metric.step is not None:
                logged["step"] = metric.step
            self._wandb.log(logged)
            partial = self._logged_path.with_suffix(".partial")
            partial.write_text(entry_id)
            partial.replace(self._logged_path)  # whole or not at all: a crash leaves the previous id
        return row

    def close(self, report: Path | None = None) -> None:
        """Close the file; with W&B, log ``report`` (a picture, when there is one) and finish the run."""
        self._file.close()
        if self._wandb is not None:
            try:
                if report is not None and Path(report).exists():
                    import wandb

                    self._wandb.log({"report": wandb.Image(str(report))})
            finally:
                self._wandb.finish()
                self._wandb = None


def wandb_config(config: RlbusConfig) -> dict[str, Any]:
    """The config a W&B run records: the resolved config without env args (a Redis URL's password shows as ``***``,
    as in every dump)."""
    envs = {"__all__": HIDDEN_ARGS}
    return config.model_dump(mode="json", exclude={"env": envs, "eval": {"env": envs}})


def _start_wandb(cfg: WandbConfig, run_name: str, output_dir: Path, config: dict | None):
    """The W&B run: a new id for a fresh run (``RUN-xxxxxxxx``, kept in ``wandb/run-id``), the kept one on resume."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError("[wandb] is configured but wandb is not installed; pip install 'rlbus[wandb]'") from e
    id_path = output_dir / "wandb" / "run-id"
    id_path.parent.mkdir(parents=True, exist_ok=True)
    if not id_path.exists():
        id_path.write_text(f"{run_name}-{uuid.uuid4().hex[:8]}")
    run = wandb.init(
        project=cfg.project, name=cfg.name or run_name, mode=cfg.mode, dir=str(output_dir), config=config or {},
        resume="allow", id=id_path.read_text().strip(),
    )
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    return run


def _entry_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id (``ms-seq``) as numbers, in stream order."""
    ms, _, seq = entry_id.strip().partition("-")
    return int(ms), int(seq or 0)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl`` (none if it has no file); a torn last line (a crash mid-write) is
    left out."""
    path = Path(path)
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # only the last line can be torn: rows are written whole, one at a time
    return rows
