"""The run report: series, summary and report.png."""

import json

import pytest

from workers.run.report import build_summary, rollout_tokens_per_s, stale_fraction, train_reward, write_report


def _rows():
    rows = []
    for step in range(1, 6):
        at = 100.0 + step
        rows.append({"id": f"{step}-0", "source": "packer", "step": step, "at": at - 0.5,
                     "packer/groups": 4.0, "packer/stale_groups": 1.0 if step == 3 else 0.0, "packer/tokens": 400.0})
        rows.append({"id": f"{step}-1", "source": "trainer", "step": step, "at": at,
                     "reward_mean": 0.1 * step if step != 4 else 0.9, "tokens_per_s": 1000.0, "loss": 0.1})
    rows.append({"id": "9-0", "source": "eval", "step": 0, "at": 100.0, "eval/e/reward": 0.05})
    rows.append({"id": "9-1", "source": "eval", "step": 5, "at": 106.0, "eval/e/reward": 0.4})
    return rows


def test_report_series_and_summary(tmp_path):
    rows = _rows()
    assert train_reward(rows)[4] == 0.9  # replays of batches alone: the trainer's reward
    with_packer = rows + [{"id": "4-9", "source": "packer", "step": 4, "at": 105.0, "packer/reward_mean": 0.3}]
    assert train_reward(with_packer) == {4: 0.3}  # the policy's reward (every sample), not the filtered ones
    assert stale_fraction(rows)[3] == pytest.approx(1 / 5)
    assert rollout_tokens_per_s(rows)[2] == pytest.approx(400.0)
    summary = build_summary(rows, run="r", steps_trained=5, max_steps=5, wall_s=12.0, groups={"produced": 1},
                            restarts={"trainer": 1}, stopped_because="max_steps")
    assert summary["reward"]["first"] == {"step": 1, "reward": pytest.approx(0.1)}
    assert summary["reward"]["last"] == {"step": 5, "reward": pytest.approx(0.5)}
    assert summary["reward"]["best"] == {"step": 4, "reward": 0.9}
    assert summary["eval"] == {"0": {"eval/e/reward": 0.05}, "5": {"eval/e/reward": 0.4}}
    json.dumps(summary)
    path = write_report(rows, tmp_path, title="t")
    assert path.stat().st_size > 10_000


def test_bench_numbers_leave_out_the_warm_up_step():
    from workers.run.report import bench_numbers

    rows = [{"id": f"{s}", "source": "trainer", "step": s, "at": 100.0 + s, "step_time_s": 9.0 if s == 1 else 0.5,
             "tokens_per_s": 100.0 * s, "wait_s": 0.1} for s in range(1, 5)]
    rows += [{"id": f"p{s}", "source": "packer", "step": s, "at": 99.0 + s, "packer/tokens": 200.0}
             for s in range(1, 5)]
    numbers = bench_numbers(rows)
    assert numbers == {"steps": 3.0, "step_s": 0.5, "train_tokens_per_s": pytest.approx(300.0),
                       "trainer_idle_s": pytest.approx(0.1), "rollout_tokens_per_s": pytest.approx(200.0)}
    assert bench_numbers([]) == {}
