"""Samples that share their prompt train exactly as if each held its own copy (loss, gradients, metrics)."""

import numpy as np
import pytest
import torch

from bus.messages import MicroBatch, Sample
from tests.trainer.helpers import VOCAB, assert_same_gradients, step_gradients
from workers.stages.packing import pack_step

torch.set_num_threads(1)


def groups(tasks: int = 3, group_size: int = 4, seed: int = 0) -> list[Sample]:
    """``tasks`` groups of ``group_size`` samples: one prompt per group, completions of 2-5 tokens (one masked)."""
    rng = np.random.default_rng(seed)
    samples = []
    for task in range(tasks):
        prompt = rng.integers(0, VOCAB, 5 + task).astype(np.int32)
        for i in range(group_size):
            n = 2 + (i + task) % 4
            mask = np.ones(n, dtype=bool)
            mask[-1] = i % 2 == 0  # an env token now and then
            samples.append(Sample(
                prompt_ids=prompt, completion_ids=rng.integers(0, VOCAB, n).astype(np.int32),
                completion_logprobs=np.where(mask, -rng.uniform(1, 3, n), 0).astype(np.float32), loss_mask=mask,
                reward=float(rng.uniform()), advantage=float(rng.normal()), temperature=0.9,
                task_id=f"env:0:{task}", index=i))
    return samples


def packed(samples: list[Sample], share: bool, seq_len: int = 16) -> list[MicroBatch]:
    return pack_step(samples, step=1, seq_len=seq_len, dp_size=1, share_prompts=share)[0]


@pytest.mark.parametrize("forward_batch", [1, 3], ids=["one-by-one", "stacked"])
def test_a_step_with_shared_prompts_equals_one_without(forward_batch):
    samples = groups()
    shared, own = packed(samples, True), packed(samples, False)
    assert any(mb.shares_prompts for mb in shared)
    tokens = sum(mb.tokens for mb in shared)
    assert tokens < sum(mb.tokens for mb in own)
    # seq_len 16 splits a group: the prompt again at the head of the part that did not fit
    assert sum(int((mb.shared_prompt_lengths == 0).sum()) if mb.shares_prompts else mb.samples for mb in shared) > 3
    m_shared, g_shared = step_gradients(shared, forward_batch=forward_batch, entropy_grad=True, entropy_coef=0.01)
    m_own, g_own = step_gradients(own, forward_batch=forward_batch, entropy_grad=True, entropy_coef=0.01)
    assert_same_gradients(g_shared, g_own, atol=1e-5)
    for name in ("loss", "loss/rl", "entropy", "mismatch_kl", "samples", "reward_mean"):
        assert m_shared[name] == pytest.approx(m_own[name], rel=1e-5, abs=1e-6), name
    assert m_shared["tokens"] == tokens


def test_a_micro_batch_rejects_a_shared_prompt_its_holder_does_not_have():
    mb = packed(groups(tasks=1, group_size=2), True, seq_len=64)[0]
    assert mb.shared_prompt_lengths.tolist() == [0, 5]
    with pytest.raises(ValueError, match="holder, sample 0, holds"):
        mb.replace(shared_prompt_lengths=np.array([0, int(mb.sample_lengths[0]) + 1], np.int32))
    with pytest.raises(ValueError, match="0 for the first sample"):
        mb.replace(shared_prompt_lengths=np.array([2, 0], np.int32))
    with pytest.raises(ValueError, match="shared_prompt_lengths has 1 entries for 2 samples"):
        mb.replace(shared_prompt_lengths=np.array([0], np.int32))
