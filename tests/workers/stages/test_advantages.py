"""GRPO advantages against hand-computed values."""

import numpy as np
import pytest

from bus.messages import Sample
from workers.batch_config import AdvantageConfig
from workers.stages.advantages import assign_advantages, group_advantages, zero_variance


def adv(rewards, tokens=None, max_tokens=None, **cfg):
    tokens = tokens if tokens is not None else [1] * len(rewards)
    return group_advantages(np.array(rewards), np.array(tokens), AdvantageConfig(**cfg), max_tokens)


def test_grpo_centres_on_the_group_mean():
    np.testing.assert_allclose(adv([1.0, 0.0, 0.0, 1.0]), [0.5, -0.5, -0.5, 0.5])
    np.testing.assert_allclose(adv([3.0, 1.0, 2.0]), [1.0, -1.0, 0.0])


def test_std_normalisation_divides_by_the_population_std():
    # rewards 1, 0, 0, 1: mean 0.5, std 0.5 → ±1
    np.testing.assert_allclose(adv([1.0, 0.0, 0.0, 1.0], std_normalize=True), [1, -1, -1, 1], atol=1e-5)


def test_length_penalty_is_subtracted_before_centring():
    # shaped = r − 0.5 × tokens / 100 = [1 − 0.5, 1 − 0.1] = [0.5, 0.9] → centred [−0.2, 0.2]
    out = adv([1.0, 1.0], tokens=[100, 20], max_tokens=100, length_penalty=0.5)
    np.testing.assert_allclose(out, [-0.2, 0.2], atol=1e-6)
    # without max_completion_tokens the group's longest completion is the scale
    np.testing.assert_allclose(adv([1.0, 1.0], tokens=[100, 20], length_penalty=0.5), [-0.2, 0.2], atol=1e-6)


def test_group_of_one_gets_zero_and_equal_rewards_give_zero():
    assert adv([0.7]).tolist() == [0.0]
    assert adv([0.7], std_normalize=True).tolist() == [0.0]
    assert adv([1.0, 1.0, 1.0], std_normalize=True).tolist() == [0.0, 0.0, 0.0]


def test_assign_writes_each_sample_and_counts_sampled_tokens_only():
    def sample(reward, mask):
        n = len(mask)
        return Sample(
            prompt_ids=[1, 2],
            completion_ids=list(range(n)),
            completion_logprobs=[0.0] * n,
            loss_mask=mask,
            reward=reward,
        )

    samples = [sample(1.0, [True, True, False, False]), sample(1.0, [True, True, True, True])]
    assign_advantages(samples, AdvantageConfig(length_penalty=1.0), max_completion_tokens=4)
    # sampled tokens 2 and 4 → shaped 0.5, 0 → ±0.25
    assert [s.advantage for s in samples] == pytest.approx([0.25, -0.25])


def test_zero_variance():
    assert zero_variance([1.0, 1.0])
    assert not zero_variance([1.0, 0.0])
    assert not zero_variance([1.0])
