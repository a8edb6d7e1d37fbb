"""Each filter on crafted samples, on both sides of its threshold; enforce vs monitor-only."""

import math

import numpy as np

from bus.messages import Sample
from workers.batch_config import (
    GibberishFilterConfig,
    RepetitionFilterConfig,
    TruncatedFilterConfig,
    ZeroAdvantageFilterConfig,
)
from workers.stages.sample_filters import (
    active_filters,
    apply_filters,
    is_gibberish,
    is_repetitive,
    is_zero_advantage,
    longest_run,
)

VOCAB = 150_000
UNIFORM = -math.log(VOCAB)


def sample(ids, logprobs, mask=None, advantage=0.5):
    mask = mask if mask is not None else [True] * len(ids)
    return Sample(
        prompt_ids=[1], completion_ids=ids, completion_logprobs=logprobs, loss_mask=mask, advantage=advantage
    )


def test_gibberish_needs_a_rare_id_and_a_low_logprob():
    cfg = GibberishFilterConfig()
    low, high = UNIFORM - 2.0 - 0.01, UNIFORM - 2.0 + 0.01
    assert is_gibberish(sample([5, 100_001], [-0.1, low]), cfg, VOCAB)
    assert not is_gibberish(sample([5, 100_001], [-0.1, high]), cfg, VOCAB)  # logprob above the bound
    assert not is_gibberish(sample([5, 100_000], [-0.1, low]), cfg, VOCAB)  # id not above the threshold
    # environment tokens are not sampled: never gibberish
    assert not is_gibberish(sample([5, 100_001], [-0.1, low], mask=[True, False]), cfg, VOCAB)


def test_repetition_needs_window_consecutive_confident_tokens():
    cfg = RepetitionFilterConfig(window=3, prob_threshold=0.99)
    sure, unsure = math.log(0.995), math.log(0.98)
    assert is_repetitive(sample([1] * 4, [unsure, sure, sure, sure]), cfg)
    assert not is_repetitive(sample([1] * 4, [sure, sure, unsure, sure]), cfg)
    # env tokens in between are skipped: the run is over the model's own tokens
    assert is_repetitive(sample([1] * 4, [sure, 0.0, sure, sure], mask=[True, False, True, True]), cfg)


def test_longest_run():
    assert longest_run(np.array([], bool)) == 0
    assert longest_run(np.array([True, True, False, True])) == 2
    assert longest_run(np.array([True] * 5)) == 5


def test_zero_advantage():
    assert is_zero_advantage(sample([1], [0.0], advantage=0.0))
    assert not is_zero_advantage(sample([1], [0.0], advantage=1e-6))


def test_truncated_drops_what_stopped_at_the_token_limit_by_default():
    ended, cut = sample([1], [0.0]), sample([1, 2], [0.0, 0.0])
    cut.is_truncated = True
    kept, counts = apply_filters([ended, cut], [TruncatedFilterConfig()], VOCAB)
    assert kept == [ended] and counts.dropped["truncated"] == 1
    assert [s.flags["truncated"] for s in (ended, cut)] == [False, True]
    kept, _ = apply_filters([ended, cut], [TruncatedFilterConfig(enforce=False)], VOCAB)
    assert kept == [ended, cut]


def test_monitor_only_annotates_and_counts_enforce_drops():
    samples = [sample([1], [0.0], advantage=0.0), sample([1], [0.0], advantage=1.0)]
    kept, counts = apply_filters(samples, [ZeroAdvantageFilterConfig(enforce=False)], VOCAB)
    assert kept == samples
    assert [s.flags["zero_advantage"] for s in samples] == [True, False]
    assert counts.flagged["zero_advantage"] == 1 and counts.dropped["zero_advantage"] == 0

    kept, counts = apply_filters(
        samples, [ZeroAdvantageFilterConfig(enforce=True), RepetitionFilterConfig()], VOCAB
    )
    assert kept == [samples[1]]
    assert counts.dropped["zero_advantage"] == 1
    assert counts.metrics("filter") == {
        "filter/seen": 2.0,
        "filter/repetition/dropped": 0.0,
        "filter/repetition/flagged": 0.0,
        "filter/zero_advantage/dropped": 1.0,
        "filter/zero_advantage/flagged": 1.0,
    }


def test_zero_advantage_applies_to_rl_groups_only():
    filters = [ZeroAdvantageFilterConfig(enforce=True), RepetitionFilterConfig()]
    assert active_filters(filters, "rl") == filters
    assert active_filters(filters, "sft") == active_filters(filters, "opd") == [filters[1]]
