"""The status panel (a terminal) and ART's status reporter (a short line per step, a block every interval)."""

import pytest

from workers.config_loader import load_config
from workers.run.status import Snapshot, StreamLag
from workers.run.status_report import Ewa, StatusReporter


def snapshot(**changes) -> Snapshot:
    values = dict(trained=3, max_steps=10, served_by={"inference-0": 3}, reward_train=0.25,
                  reward_eval={"e/reward": 0.5}, eval_step=2, gen_tokens_per_s=4200.0, train_tokens_per_s=900.0,
                  step_s=0.4, trainer_idle_s=0.1,
                  counters={"groups_packed": 24, "groups_stale": 2, "rollouts_started": 30, "rollouts_finished": 27,
                            "samples_zero_variance": 16},
                  dead=1, lags=[StreamLag("tasks:e", "rollout", 10, 3, 2)], restarts={"trainer": 1},
                  events=["12:00:00 trainer exited with code -9; restarting in 1s"], elapsed_s=5.0)
    return Snapshot(**{**values, **changes})


def test_status_panel():
    from rich.console import Console

    from workers.run.status import render

    console = Console(record=True, width=140)
    console.print(render(snapshot(), "rlbus run t"))
    text = console.export_text()
    for shown in ("step 3/10", "0.250", "e/reward 0.500", "4.2k", "24", "2 / 0 / 1", "tasks:e", "trainer×1",
                  "inference-0=3", "restarting in 1s"):
        assert shown in text, shown


def test_a_short_line_per_step_and_a_smoothed_block_every_interval():
    reporter = StatusReporter(interval_s=60, ewa_alpha=0.5)
    reporter.observe(snapshot(reward_train=0.2))
    reporter.observe(snapshot(reward_train=0.4))
    line = reporter.step_line(snapshot(reward_train=0.4))
    assert line.startswith("step 3/10 reward=0.400 (ewa 0.300)") and "stale=2" in line and "zero_var=16" in line
    assert len(line) < 130
    assert not reporter.block_due(snapshot(elapsed_s=5.0))  # the first block comes one interval in
    assert not reporter.block_due(snapshot(elapsed_s=64.0))
    assert reporter.block_due(snapshot(elapsed_s=65.0))
    assert not reporter.block_due(snapshot(elapsed_s=100.0)) and reporter.block_due(snapshot(elapsed_s=125.0))
    block = reporter.block(snapshot())
    assert block.startswith("[status] step 3/10")
    for shown in ("train 0.250 (ewa 0.300)", "started 30  finished 27  errored 1  queued 3", "stale groups 2",
                  "zero-variance samples 16", "tasks:e[rollout]=3+2", "eval @ step 2: e/reward 0.500"):
        assert shown in block, shown


def test_ewa_and_the_status_knobs():
    ewa = Ewa(0.2)
    for value in (1.0, 0.0, 0.0):
        ewa.add("x", value)
    assert ewa.get("x") == pytest.approx(0.64)
    config = load_config([], [("status.status_ewa_alpha", "0.5"), ("status.log_interval_seconds", "10")])
    assert (config.status.ewa_alpha, config.status.log_interval_seconds) == (0.5, 10.0)
