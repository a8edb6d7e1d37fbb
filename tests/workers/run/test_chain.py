"""``rlbus run`` of a config with ``[[stage]]``s: stages in turn, each from the previous one's last weights; a
stage that did not finish stops the chain; ``--resume`` skips the finished ones. The stage runs themselves are
stand-ins here (the quick-start test in test_session_e2e runs the real thing)."""

import argparse
import json
import shutil
from pathlib import Path

import pytest

from bus.errors import ConfigError
from workers.config_loader import load_config
from workers.run import chain

CHAIN = """
[run]
name = "c"
output_dir = "{out}"
[[env]]
id = "reverse_text"
[[stage]]
name = "sft"
[stage.run]
max_steps = 3
[[stage.env]]
id = "reverse_text"
mode = "sft"
sft_source = "reference"
[[stage]]
name = "rl"
[stage.run]
max_steps = 2
[[stage]]
name = "more"
[stage.run]
max_steps = 1
"""


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "chain.toml"
    path.write_text(CHAIN.format(out=tmp_path / "out"))
    return load_config([path])


class StandIn:
    """Records each stage run and leaves what a finished run leaves (summary, metrics, last weights)."""

    def __init__(self, stopped_because: dict[str, str] | None = None):
        self.calls: list[tuple[str, str, bool]] = []
        self.stopped_because = stopped_because or {}

    def __call__(self, config, args, *, resume, attach):
        out = Path(config.run.output_dir)
        name = config.run.name.removeprefix("c-")
        self.calls.append((name, config.model.path, resume))
        steps = config.run.max_steps
        (out / "weights" / f"step_{steps}").mkdir(parents=True, exist_ok=True)
        (out / "weights" / f"step_{steps}" / "config.json").write_text("{}")
        why = self.stopped_because.get(name, "max_steps")
        (out / "summary.json").write_text(json.dumps({"steps_trained": steps, "wall_s": 1.0, "stopped_because": why,
                                                      "eval": {"0": {"eval/x/reward": 0.1}}}))
        row = {"source": "packer", "step": 1, "packer/reward_mean": 0.5}
        (out / "metrics.jsonl").write_text(json.dumps(row) + "\n")
        return (0 if why == "max_steps" else 1), why


def args(resume=False):
    return argparse.Namespace(resume=resume, attach=False, grace_s=1.0, health_timeout_s=1.0)


def test_stages_run_in_turn_each_from_the_previous_ones_last_weights(config, tmp_path, monkeypatch):
    runs = StandIn()
    monkeypatch.setattr(chain, "run_once", runs)
    assert chain.run_stages(config, args()) == 0
    out = tmp_path / "out"
    assert runs.calls == [("sft", "outputs/models/tiny", False), ("rl", str(out / "sft" / "weights" / "step_3"), False),
                          ("more", str(out / "rl" / "weights" / "step_2"), False)]
    summary = json.loads((out / "summary.json").read_text())
    assert [s["stage"] for s in summary["stages"]] == ["sft", "rl", "more"]
    assert (out / "report.png").stat().st_size > 0


def test_a_stage_that_did_not_finish_stops_the_chain(config, monkeypatch):
    runs = StandIn({"rl": "signal"})
    monkeypatch.setattr(chain, "run_once", runs)
    assert chain.run_stages(config, args()) == 1
    assert [c[0] for c in runs.calls] == ["sft", "rl"]


def test_resume_skips_the_finished_stages_and_resumes_the_first_that_did_not(config, tmp_path, monkeypatch):
    monkeypatch.setattr(chain, "run_once", StandIn({"rl": "signal"}))
    chain.run_stages(config, args())
    shutil.rmtree(tmp_path / "out" / "rl")  # what an interrupted stage leaves: its folder, no summary
    (tmp_path / "out" / "rl").mkdir()
    runs = StandIn()
    monkeypatch.setattr(chain, "run_once", runs)
    assert chain.run_stages(config, args(resume=True)) == 0
    assert [(c[0], c[2]) for c in runs.calls] == [("rl", True), ("more", False)]


def test_a_stage_whose_previous_weights_are_gone_is_a_config_error_naming_the_folder(config, tmp_path, monkeypatch):
    monkeypatch.setattr(chain, "run_once", StandIn())
    chain.run_stages(config, args())
    (tmp_path / "out" / "sft" / "weights" / "step_3" / "config.json").unlink()
    (tmp_path / "out" / "rl" / "summary.json").unlink()
    with pytest.raises(ConfigError, match=r"sft/weights/step_3 are not there"):
        chain.run_stages(config, args(resume=True))


def test_resume_runs_a_finished_stage_again_when_its_max_steps_was_raised(config, tmp_path, monkeypatch):
    monkeypatch.setattr(chain, "run_once", StandIn())
    chain.run_stages(config, args())
    raised = config.model_copy(deep=True)
    raised.stage[2].config.run.max_steps = 4
    runs = StandIn()
    monkeypatch.setattr(chain, "run_once", runs)
    assert chain.run_stages(raised, args(resume=True)) == 0
    assert [(c[0], c[2]) for c in runs.calls] == [("more", True)]
