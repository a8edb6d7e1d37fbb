"""``rlbus run @ cfg.toml [--resume] [--attach]``: one run, or the config's ``[[stage]]``s one after another.

Each stage is a whole run in ``run.output_dir/NAME`` (its own Redis, weights, checkpoints, metrics, summary and
report), started when the previous one reached its ``max_steps`` or ran out of data; a stage with
``from_previous`` starts from the previous stage's last weights (a whole Hugging Face folder). ``--resume`` skips
the stages that finished and resumes the first that did not. At the end, ``run.output_dir/summary.json`` lists
every stage and ``run.output_dir/report.png`` puts their curves on one step axis.
"""

import argparse
import asyncio
import json
from pathlib import Path

from bus.errors import ConfigError
from bus.state import DATA_EXHAUSTED
from workers.config import RlbusConfig
from workers.run.metrics import read_rows
from workers.run.report import stages_text, write_stages_report, write_summary
from workers.run.session import RunSession

FINISHED = ("max_steps", DATA_EXHAUSTED)
"""How a stage ends for the next one to start (``summary.json``'s ``stopped_because``)."""


def main(config: RlbusConfig, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlbus run", description="Start and supervise a whole run on this machine.")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in output_dir from its checkpoint and streams")
    parser.add_argument("--attach", action="store_true",
                        help="only watch/eval/summarise a run whose workers run elsewhere")
    parser.add_argument("--grace-s", type=float, default=15.0, help="seconds children get to drain after SIGTERM")
    parser.add_argument("--health-timeout-s", type=float, default=180.0,
                        help="wait this long for each inference server")
    args = parser.parse_args(argv)
    if not config.stage:
        return run_once(config, args, resume=args.resume, attach=args.attach)[0]
    if args.attach:
        raise ConfigError("--attach watches one run, and this config has [[stage]]s; attach to one stage with "
                          f"@ {Path(config.run.output_dir) / config.stage[0].name / 'config.resolved.toml'}")
    return run_stages(config, args)


def run_once(config: RlbusConfig, args: argparse.Namespace, *, resume: bool, attach: bool) -> tuple[int, str]:
    """One supervised run: (exit code, why it stopped)."""
    session = RunSession(config, resume=resume, attach=attach, grace_s=args.grace_s,
                         health_timeout_s=args.health_timeout_s)
    code = asyncio.run(session.run())
    return code, session.stopped_because


def run_stages(config: RlbusConfig, args: argparse.Namespace) -> int:
    out = Path(config.run.output_dir)
    if not args.resume:
        for stage in config.stage:  # results of an earlier chain must not pass for this one's
            (Path(stage.config.run.output_dir) / "summary.json").unlink(missing_ok=True)
    summaries: list[dict] = []
    code = 0
    for i, stage in enumerate(config.stage):
        stage_config = stage.config
        stage_out = Path(stage_config.run.output_dir)
        summary = read_summary(stage_out) if args.resume else None
        if summary is not None and finished(summary, stage_config):
            print(f"rlbus run: stage {stage.name} finished before ({summary['steps_trained']} steps); skipped",
                  flush=True)
        else:
            if stage.from_previous:
                stage_config = with_model_path(stage_config, last_weights(config.stage[i - 1].config, summaries[-1]))
            print(f"rlbus run: stage {i + 1}/{len(config.stage)} {stage.name} in {stage_out}", flush=True)
            code, _ = run_once(stage_config, args, resume=args.resume and stage_out.exists(),
                                             attach=False)
            summary = read_summary(stage_out)
            if summary is None:
                return code or 1
        summaries.append({"stage": stage.name, "output_dir": str(stage_out), **summary})
        if code or summary.get("stopped_because") not in FINISHED:
            code = code or 1
            break
    write_summary({"run": config.run.name, "stages": summaries}, out)
    rows = [(s["stage"], read_rows(Path(s["output_dir"]) / "metrics.jsonl"), not all_from_references(stage.config))
            for s, stage in zip(summaries, config.stage, strict=False)]
    write_stages_report(rows, out, title=f"rlbus run {config.run.name}")
    print(stages_text(summaries, out), flush=True)
    return code


def finished(summary: dict, config: RlbusConfig) -> bool:
    """Whether a stage's summary says it is done under ``config`` (a raised ``max_steps`` means it is not)."""
    if summary.get("stopped_because") == DATA_EXHAUSTED:
        return True
    wanted = config.run.max_steps
    return summary.get("stopped_because") == "max_steps" and (wanted is None or summary["steps_trained"] >= wanted)


def all_from_references(config: RlbusConfig) -> bool:
    """Whether every env trains on reference answers (whose training reward says nothing: they all score alike)."""
    return all(env.mode == "sft" and env.sft_source == "reference" for env in config.env)


def read_summary(output_dir: Path) -> dict | None:
    path = output_dir / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def last_weights(previous: RlbusConfig, summary: dict) -> Path:
    """The weights folder of the previous stage's last trained step."""
    folder = Path(previous.run.output_dir) / "weights" / f"step_{summary['steps_trained']}"
    if not (folder / "config.json").exists():
        raise ConfigError(f"the previous stage's last weights {folder} are not there; rerun it without --resume, "
                          "or set this stage's model.path")
    return folder


def with_model_path(config: RlbusConfig, path: Path) -> RlbusConfig:
    """``config`` starting from the weights at ``path`` (set, so that the children's resolved config has it)."""
    config = config.model_copy(deep=True)
    config.model = config.model.model_copy(update={"path": str(path)})
    config.model.model_fields_set.add("path")
    return config
