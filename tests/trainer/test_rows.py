"""A micro-batch of several groups trains cut into rows of its groups: the same logprobs and gradients as the one
long packed sequence, at the cost of rows no wider than the longest group."""

import numpy as np
import pytest
import torch

from tests.trainer.helpers import assert_same_gradients, step_gradients, tiny_lm
from tests.trainer.test_shared_prompts import groups, packed
from trainer.logprobs import PolicyModel, packed_layout
from trainer.rows import lay_out, pack_segments, segments

torch.set_num_threads(1)


def test_a_micro_batch_cuts_where_a_sample_holds_its_own_prompt():
    parts = segments(0, np.array([5, 2, 3, 4, 2]), np.array([0, 3, 3, 0, 4]))
    assert [(p.start, p.end, p.lengths, p.shared) for p in parts] == [(0, 10, [5, 2, 3], [0, 3, 3]),
                                                                      (10, 16, [4, 2], [0, 4])]
    assert [(p.start, p.end) for p in segments(1, np.array([3, 4]), None)] == [(0, 3), (3, 7)]


def test_segments_fill_rows_as_wide_as_the_longest_first_fit_decreasing():
    parts = segments(0, np.array([6, 2, 3, 4, 1]), None)
    width, rows = pack_segments(parts)
    assert width == 6
    assert [[p.end - p.start for p in row] for row in rows] == [[6], [4, 2], [3, 1]]


def test_rows_give_each_token_the_logprob_of_the_long_packed_sequence():
    mbs = packed(groups(tasks=4, group_size=3), True, seq_len=64)
    assert any(int((mb.shared_prompt_lengths == 0).sum()) > 1 for mb in mbs if mb.shares_prompts)
    model = PolicyModel(tiny_lm(), entropy_grad=True).eval()
    as_long = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.long)  # noqa: E731
    shared = [np.asarray(mb.shared_prompt_lengths, dtype=np.int64) if mb.shares_prompts else None for mb in mbs]
    rows = lay_out([as_long(mb.input_ids) for mb in mbs], [as_long(mb.position_ids) for mb in mbs],
                   [torch.as_tensor(np.asarray(mb.temperatures)) for mb in mbs],
                   [np.asarray(mb.sample_lengths, dtype=np.int64) for mb in mbs], shared)
    assert rows.input_ids.shape[1] < max(len(mb.input_ids) for mb in mbs)
    with torch.no_grad():
        out = model(*rows.inputs())
        for mb, index, reads in zip(mbs, rows.index, shared, strict=True):
            lengths = torch.as_tensor(np.asarray(mb.sample_lengths, dtype=np.int64))
            layout = packed_layout(lengths, torch.as_tensor(reads) if reads is not None else torch.zeros_like(lengths))
            whole = model(as_long(mb.input_ids), as_long(mb.position_ids),
                          torch.as_tensor(np.asarray(mb.temperatures)), *layout)
            assert torch.equal(rows.input_ids.reshape(-1)[index], as_long(mb.input_ids))
            torch.testing.assert_close(out.logprobs.reshape(-1)[index], whole.logprobs, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out.entropy.reshape(-1)[index], whole.entropy, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("forward_batch", [1, 2], ids=["one-by-one", "stacked"])
def test_a_step_over_micro_batches_of_several_groups_equals_one_without_sharing(forward_batch):
    samples = groups(tasks=4, group_size=3)
    shared, own = packed(samples, True, seq_len=64), packed(samples, False, seq_len=64)
    m_shared, g_shared = step_gradients(shared, forward_batch=forward_batch, entropy_grad=True, entropy_coef=0.01)
    m_own, g_own = step_gradients(own, forward_batch=forward_batch, entropy_grad=True, entropy_coef=0.01)
    assert_same_gradients(g_shared, g_own, atol=1e-5)
    for name in ("loss", "loss/rl", "entropy", "mismatch_kl", "samples", "reward_mean"):
        assert m_shared[name] == pytest.approx(m_own[name], rel=1e-5, abs=1e-6), name


def test_rows_laid_out_at_once_match_each_row_laid_out_alone():
    rows = [([5, 2, 3, 2], [0, 3, 3, 0]), ([4, 2, 6], [0, 4, 0]), ([3, 9], [0, 0])]
    lengths = torch.tensor([n for row, _ in rows for n in row])
    shared = torch.tensor([s for _, row in rows for s in row])
    mask, sources = packed_layout(lengths, shared, width=12)
    for r, (row_lengths, row_shared) in enumerate(rows):
        alone = packed_layout(torch.tensor(row_lengths), torch.tensor(row_shared))
        assert torch.equal(mask[r], alone[0]) and torch.equal(sources[r], alone[1])
