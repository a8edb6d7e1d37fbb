"""Eval math: pass@k, eval values, which steps are due."""

import pytest

from workers.run.eval import eval_steps_due, eval_values, k_values, next_eval_step, pass_at_k


def test_pass_at_k_hand_computed():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 3, 2) == 1.0  # n - c < k: every k-subset has a correct one
    with pytest.raises(ValueError, match="c ≤ n"):
        pass_at_k(2, 3, 1)


def test_eval_values_binary_and_continuous():
    assert k_values(8) == [1, 2, 4, 8] and k_values(6) == [1, 2, 4, 6] and k_values(1) == [1]
    binary = eval_values("e", [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    assert binary["eval/e/reward"] == pytest.approx(3 / 8)
    assert binary["eval/e/pass@1"] == pytest.approx((0.25 + 0.5) / 2)
    assert binary["eval/e/pass@4"] == pytest.approx(1.0)
    continuous = eval_values("e", [[0.5, 0.25]])
    assert continuous == {"eval/e/reward": pytest.approx(0.375), "eval/e/examples": 1.0}


def test_eval_steps_due():
    assert eval_steps_due(0, None, 10, 30, skip_first=False) == 0
    assert eval_steps_due(0, None, 10, 30, skip_first=True) is None
    assert eval_steps_due(9, 0, 10, 30, skip_first=False) is None
    assert eval_steps_due(10, 0, 10, 30, skip_first=False) == 10
    assert eval_steps_due(10, 10, 10, 30, skip_first=False) is None
    assert eval_steps_due(23, 0, 10, 30, skip_first=False) == 10  # in order: the oldest not yet issued
    assert eval_steps_due(25, 20, 10, 25, skip_first=False) == 25  # max_steps always evaluated
    assert next_eval_step(None, 10, 25, skip_first=True) == 10
    assert next_eval_step(10, 10, 25, skip_first=False) == 20
    assert next_eval_step(20, 10, 25, skip_first=False) == 25
    assert next_eval_step(25, 10, 25, skip_first=False) is None
    assert next_eval_step(3, 10, None, skip_first=False) == 10
