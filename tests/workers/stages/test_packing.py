"""Packing invariants (hypothesis) and the arrays of a hand-built micro-batch."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bus.messages import MODES, MicroBatch, Sample
from workers.stages.packing import first_fit_decreasing, pack_step, plan, truncate


def make_sample(
    uid: int, prompt: int, completion: int, advantage: float = 1.0, teacher: bool = False, mode: str = "rl"
) -> Sample:
    """Token ids encode (sample uid, position) so every packed token can be traced back."""
    ids = uid * 100_000 + np.arange(prompt + completion, dtype=np.int32)
    mask = np.ones(completion, dtype=bool)
    mask[1::3] = False  # some env tokens
    return Sample(
        prompt_ids=ids[:prompt],
        completion_ids=ids[prompt:],
        completion_logprobs=np.where(mask, -0.5, 0.0).astype(np.float32),
        loss_mask=mask,
        teacher_logprobs=np.full(completion, -0.25, np.float32) if teacher else None,
        reward=float(uid),
        advantage=advantage,
        policy_version_start=uid % 5,
        temperature=0.7,
        mode=mode,
        task_id=f"t{uid}",
        index=uid,
    )


def test_micro_batch_arrays_by_hand():
    a = make_sample(1, prompt=2, completion=3, advantage=0.5)
    b = make_sample(2, prompt=1, completion=2, advantage=-1.0, teacher=True)
    batches, stats = pack_step([a, b], step=3, seq_len=16, dp_size=2)
    assert len(batches) == 2 and stats.padding_micro_batches == 1
    mb, pad = batches
    assert (mb.step, mb.index, mb.count, mb.mode) == (3, 0, 2, "rl")
    # first-fit decreasing: the longer sample (a, 5 tokens) first
    assert mb.input_ids.tolist() == [100000, 100001, 100002, 100003, 100004, 200000, 200001, 200002]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert mb.loss_mask.tolist() == [False, False, True, False, True, False, True, False]
    assert mb.advantages.tolist() == [0, 0, 0.5, 0, 0.5, 0, -1.0, 0]
    assert mb.inference_logprobs.tolist() == [0, 0, -0.5, 0, -0.5, 0, -0.5, 0]
    assert mb.teacher_logprobs.tolist() == [0, 0, 0, 0, 0, 0, -0.25, 0]
    assert mb.sample_lengths.tolist() == [5, 3]
    assert mb.policy_versions.tolist() == [1, 2]
    assert mb.rewards.tolist() == [1.0, 2.0]
    assert mb.task_ids == ["t1", "t2"] and mb.sample_indices.tolist() == [1, 2]  # who was trained, auditable
    assert pad.task_ids == [""]
    assert np.allclose(mb.temperatures, 0.7)
    assert pad.loss_tokens == 0 and pad.index == 1 and pad.count == 2
    # survives the wire
    again = MicroBatch.from_fields(mb.to_fields())
    assert again.input_ids.tolist() == mb.input_ids.tolist() and again.mode == "rl"


def test_truncation_keeps_the_prompt_first_and_counts():
    s = make_sample(1, prompt=4, completion=10)
    cut, was_cut = truncate(s, 8)
    assert was_cut and cut.num_tokens == 8 and len(cut.completion_ids) == 4 and len(cut.loss_mask) == 4
    assert truncate(s, 14) == (s, False)
    _, stats = pack_step([s], step=1, seq_len=8, dp_size=1)
    assert stats.truncated == 1 and stats.tokens == 8


def test_ffd_fills_bins_first_fit():
    assert first_fit_decreasing([5, 4, 3, 3, 1], 8) == [[0, 2], [1, 3, 4]]
    assert first_fit_decreasing([], 8) == []


samples_strategy = st.lists(
    st.tuples(st.integers(1, 40), st.integers(0, 60), st.sampled_from(MODES)), min_size=0, max_size=40
)


@settings(max_examples=150, deadline=None)
@given(specs=samples_strategy, seq_len=st.integers(8, 96), dp=st.integers(1, 4))
def test_packing_invariants(specs, seq_len, dp):
    samples = [make_sample(i + 1, p, c, teacher=(m == "opd"), mode=m) for i, (p, c, m) in enumerate(specs)]
    modes = [m for _, _, m in specs]
    batches, stats = pack_step(samples, step=1, seq_len=seq_len, dp_size=dp)

    assert len(batches) % dp == 0 and len(batches) >= dp
    assert [mb.index for mb in batches] == list(range(len(batches)))
    assert all(mb.count == len(batches) for mb in batches)
    seen = []
    for mb in batches:
        assert mb.tokens <= seq_len
        assert int(mb.sample_lengths.sum()) == mb.tokens
        if mb.loss_tokens == 0 and mb.tokens == 1 and mb.input_ids[0] == 0:
            # padding: contributes nothing
            assert not mb.loss_mask.any() and not mb.advantages.any() and not mb.inference_logprobs.any()
            continue
        starts = np.cumsum(mb.sample_lengths) - mb.sample_lengths
        for start, length in zip(starts, mb.sample_lengths, strict=True):
            ids = mb.input_ids[start : start + length]
            uid = int(ids[0]) // 100_000
            assert modes[uid - 1] == mb.mode  # one mode per micro-batch
            assert mb.position_ids[start : start + length].tolist() == list(range(length))
            seen.append((uid, ids.tolist()))
    # every input token (after truncation to seq_len) appears exactly once
    expected = sorted(
        (i + 1, (np.arange(p + c) + (i + 1) * 100_000)[:seq_len].tolist())
        for i, (p, c, _) in enumerate(specs)
    )
    assert sorted(seen) == expected
    assert stats.truncated == sum(p + c > seq_len for p, c, _ in specs)
    assert stats.tokens == sum(min(p + c, seq_len) for p, c, _ in specs)
    # loss mask and advantages only on sampled completion tokens
    assert stats.loss_tokens == sum(mb.loss_tokens for mb in batches)


@given(lengths=st.lists(st.integers(1, 50), max_size=60), modes=st.lists(st.sampled_from(MODES), max_size=60))
@settings(max_examples=100, deadline=None)
def test_plan_never_mixes_modes_and_bins_fit(lengths, modes):
    n = min(len(lengths), len(modes))
    lengths, modes = lengths[:n], modes[:n]
    bins = plan(lengths, modes, 50, 3)
    assert len(bins) % 3 == 0
    placed = sorted(i for _, members in bins for i in members)
    assert placed == list(range(n))
    for mode, members in bins:
        assert all(modes[i] == mode for i in members)
        assert sum(lengths[i] for i in members) <= 50


def test_a_group_shares_one_copy_of_its_prompt_split_where_it_does_not_fit():
    prompt = np.array([7, 8, 9], np.int32)

    def answer(index: int, completion: list[int]) -> Sample:
        return Sample(prompt_ids=prompt, completion_ids=np.array(completion, np.int32),
                      completion_logprobs=np.full(len(completion), -0.5, np.float32),
                      loss_mask=np.ones(len(completion), bool), advantage=float(index), task_id="e:0:1", index=index)

    samples = [answer(0, [1, 2]), answer(1, [3]), answer(2, [4, 5, 6]), answer(3, []), make_sample(9, 2, 2)]
    batches, stats = pack_step(samples, step=1, seq_len=8, dp_size=1, share_prompts=True)
    # answers 0 and 1 share a prompt; answer 2 does not fit beside them and holds its own; an empty answer and another
    # task's sample share nothing
    assert stats.tokens == (3 + 2 + 1) + (3 + 3) + 3 + 4
    mb = next(mb for mb in batches if mb.shares_prompts)
    assert mb.task_ids == ["e:0:1", "e:0:1"] and mb.sample_indices.tolist() == [0, 1]
    assert mb.input_ids.tolist() == [7, 8, 9, 1, 2, 3]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 4, 3]  # answer 1 goes on from the prompt
    assert mb.shared_prompt_lengths.tolist() == [0, 3] and mb.sample_lengths.tolist() == [5, 1]
    assert mb.loss_mask.tolist() == [False, False, False, True, True, True]
    assert mb.advantages.tolist() == [0, 0, 0, 0, 0, 1]
    assert sum(mb.shares_prompts for mb in batches) == 1
    unshared, plain = pack_step(samples, step=1, seq_len=8, dp_size=1)
    assert plain.tokens == 5 + 4 + 6 + 3 + 4 and not any(mb.shares_prompts for mb in unshared)
