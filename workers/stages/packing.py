"""Packing a step's samples into micro-batches (pure functions, no Redis).

Samples longer than ``seq_len`` are truncated (and counted); the rest are packed first-fit
decreasing into micro-batches of at most ``seq_len`` tokens, one training mode per micro-batch.
With ``share_prompts``, the samples of one group that have the same prompt go in as one unit: the prompt once,
then each completion (``MicroBatch.shared_prompt_lengths``), so a group of 8 samples of a 70-token prompt and
10-token completions is 150 tokens to train instead of 640; a unit longer than ``seq_len`` is split, the prompt
again at the head of each part. The micro-batch count is padded up to a multiple of the trainer's data-parallel
size with padding micro-batches: one 1-token dummy sample whose loss mask is all False (it contributes
nothing to any loss; ``MicroBatch.loss_tokens == 0`` tells it apart).
"""

from dataclasses import dataclass

import numpy as np

from bus.messages import MODES, MicroBatch, Mode, Sample

PAD_TOKEN_ID = 0
"""Token id of the dummy token in a padding micro-batch (never trained on)."""


@dataclass
class PackStats:
    """Numbers about one packed step."""

    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0
    micro_batches: int = 0
    padding_micro_batches: int = 0
    capacity: int = 0

    @property
    def efficiency(self) -> float:
        """Real tokens / micro-batch capacity (micro_batches × seq_len)."""
        return self.tokens / self.capacity if self.capacity else 0.0


def truncate(sample: Sample, seq_len: int) -> tuple[Sample, bool]:
    """The sample cut to its first ``seq_len`` tokens (prompt first), and whether it was cut."""
    if sample.num_tokens <= seq_len:
        return sample, False
    prompt = len(sample.prompt_ids)
    keep = max(seq_len - prompt, 0)
    update: dict = {
        "prompt_ids": sample.prompt_ids[:seq_len],
        "completion_ids": sample.completion_ids[:keep],
        "completion_logprobs": sample.completion_logprobs[:keep],
        "loss_mask": sample.loss_mask[:keep],
    }
    if sample.teacher_logprobs is not None:
        update["teacher_logprobs"] = sample.teacher_logprobs[:keep]
    return sample.replace(**update), True


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of total ≤ capacity, first-fit decreasing.

    A max segment tree over bin slack finds the first bin that fits in O(log n), so 10k items
    pack in well under a second. Unopened bins sit to the right at full capacity.
    """
    n = len(lengths)
    if n == 0:
        return []
    too_long = [x for x in lengths if x > capacity]
    if too_long:
        raise ValueError(
            f"item of {max(too_long)} tokens exceeds the bin capacity {capacity}; truncate it first"
        )
    size = 1
    while size < n:
        size *= 2
    tree = [capacity] * (2 * size)
    bins: list[list[int]] = []
    order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable").tolist()
    for i in order:
        need = lengths[i]
        node = 1
        while node < size:
            node = 2 * node if tree[2 * node] >= need else 2 * node + 1
        leaf = node - size
        if leaf == len(bins):
            bins.append([])
        bins[leaf].append(i)
        tree[node] -= need
        node //= 2
        while node:
            left, right = tree[2 * node], tree[2 * node + 1]
            tree[node] = left if left >= right else right
            node //= 2
    return bins


def plan(lengths: list[int], modes: list[Mode], seq_len: int, dp_size: int) -> list[tuple[Mode, list[int]]]:
    """Micro-batch plan: (mode, sample indices) per micro-batch; padding entries have no indices.

    Modes never mix; the number of entries is a multiple of ``dp_size``.
    """
    bins: list[tuple[Mode, list[int]]] = []
    for mode in MODES:
        members = [i for i, m in enumerate(modes) if m == mode]
        for b in first_fit_decreasing([lengths[i] for i in members], seq_len):
            bins.append((mode, sorted(members[j] for j in b)))
    pad_mode: Mode = bins[-1][0] if bins else "rl"
    while not bins or len(bins) % dp_size:
        bins.append((pad_mode, []))
    return bins


def prompt_units(samples: list[Sample], seq_len: int) -> list[list[int]]:
    """Indices of ``samples`` in units that share one prompt: consecutive samples of one task and mode with equal
    prompt ids, as many to a unit as fit ``seq_len`` (the prompt once, then each completion). A sample with no
    prompt or no completion tokens is a unit of its own."""
    units: list[list[int]] = []
    size = 0
    for i, sample in enumerate(samples):
        if units and _shares(samples[units[-1][0]], sample) and size + len(sample.completion_ids) <= seq_len:
            units[-1].append(i)
            size += len(sample.completion_ids)
        else:
            units.append([i])
            size = sample.num_tokens
    return units


def _shares(holder: Sample, sample: Sample) -> bool:
    """Whether ``sample`` can read its prompt from ``holder``: same task and mode, same prompt, both completions
    non-empty."""
    return (sample.task_id == holder.task_id and sample.mode == holder.mode and len(holder.completion_ids) > 0
            and len(sample.completion_ids) > 0 and len(holder.prompt_ids) > 0
            and np.array_equal(sample.prompt_ids, holder.prompt_ids))


def build_micro_batch(units: list[list[Sample]], *, step: int, index: int, count: int, mode: Mode) -> MicroBatch:
    """Concatenate ``units`` (already ≤ seq_len in total) into one MicroBatch; empty → padding. The samples of a unit
    share its first sample's prompt: the first holds it, the others only their completions."""
    samples = [s for unit in units for s in unit]
    if not samples:
        return padding_micro_batch(step=step, index=index, count=count, mode=mode)
    shared = np.array([0 if j == 0 else len(s.prompt_ids) for unit in units for j, s in enumerate(unit)],
                      dtype=np.int32)
    completions = np.array([len(s.completion_ids) for s in samples], dtype=np.int32)
    lengths = completions + np.where(shared > 0, 0, [len(s.prompt_ids) for s in samples]).astype(np.int32)
    with_teacher = any(s.teacher_logprobs is not None for s in samples)
    ids, mask, logprobs, teacher = [], [], [], []
    for s, p in zip(samples, shared.tolist(), strict=True):
        if not p:
            prompt_zeros = np.zeros(len(s.prompt_ids), dtype=np.float32)
            ids.append(s.prompt_ids)
            mask.append(np.zeros(len(s.prompt_ids), dtype=bool))
            logprobs.append(prompt_zeros)
            if with_teacher:
                teacher.append(prompt_zeros)
        ids.append(s.completion_ids)
        mask.append(s.loss_mask)
        logprobs.append(s.completion_logprobs)
        if with_teacher:
            teacher.append(_teacher(s))
    input_ids = np.concatenate(ids)
    loss_mask = np.concatenate(mask)
    zero = np.float32(0)
    starts = np.cumsum(lengths) - lengths
    position_ids = (np.arange(int(lengths.sum()), dtype=np.int32) - np.repeat(starts - shared, lengths)).astype(
        np.int32
    )
    advantages = np.repeat(np.array([s.advantage for s in samples], dtype=np.float32), lengths)
    temperatures = np.repeat(np.array([s.temperature for s in samples], dtype=np.float32), lengths)
    return MicroBatch(
        step=step,
        index=index,
        count=count,
        mode=mode,
        input_ids=input_ids.astype(np.int32, copy=False),
        position_ids=position_ids,
        loss_mask=loss_mask,
        advantages=np.where(loss_mask, advantages, zero),
        inference_logprobs=np.where(loss_mask, np.concatenate(logprobs), zero),
        teacher_logprobs=np.where(loss_mask, np.concatenate(teacher), zero) if with_teacher else None,
        temperatures=temperatures,
        sample_lengths=lengths,
        policy_versions=np.array([s.policy_version_start for s in samples], dtype=np.int32),
        rewards=np.array([s.reward for s in samples], dtype=np.float32),
        task_ids=[s.task_id for s in samples],
        sample_indices=np.array([s.index for s in samples], dtype=np.int32),
        shared_prompt_lengths=shared if shared.any() else np.zeros(0, dtype=np.int32),
    )


def _teacher(sample: Sample) -> np.ndarray:
    if sample.teacher_logprobs is not None:
        return sample.teacher_logprobs
    return np.zeros(len(sample.completion_ids), dtype=np.float32)


def padding_micro_batch(*, step: int, index: int, count: int, mode: Mode) -> MicroBatch:
    """A zero-loss micro-batch: one dummy token, loss mask False, so every rank runs the same count."""
    return MicroBatch(
        step=step,
        index=index,
        count=count,
        mode=mode,
        input_ids=np.array([PAD_TOKEN_ID], dtype=np.int32),
        position_ids=np.zeros(1, dtype=np.int32),
        loss_mask=np.zeros(1, dtype=bool),
        advantages=np.zeros(1, dtype=np.float32),
        inference_logprobs=np.zeros(1, dtype=np.float32),
        temperatures=np.ones(1, dtype=np.float32),
        sample_lengths=np.ones(1, dtype=np.int32),
        policy_versions=np.array([max(step - 1, 0)], dtype=np.int32),
        rewards=np.zeros(1, dtype=np.float32),
        task_ids=[""],
        sample_indices=np.zeros(1, dtype=np.int32),
    )


def pack_step(
    samples: list[Sample], *, step: int, seq_len: int, dp_size: int, share_prompts: bool = False
) -> tuple[list[MicroBatch], PackStats]:
    """Truncate, plan and build every micro-batch of step ``step`` (each sample's own mode picks its micro-batch);
    with ``share_prompts``, a group's samples share one copy of their prompt (:func:`prompt_units`)."""
    stats = PackStats(samples=len(samples))
    cut: list[Sample] = []
    for sample in samples:
        short, was_cut = truncate(sample, seq_len)
        stats.truncated += was_cut
        cut.append(short)
    units = prompt_units(cut, seq_len) if share_prompts else [[i] for i in range(len(cut))]
    lengths = [cut[u[0]].num_tokens + sum(len(cut[i].completion_ids) for i in u[1:]) for u in units]
    bins = plan(lengths, [cut[u[0]].mode for u in units], seq_len, dp_size)
    count = len(bins)
    batches = [
        build_micro_batch([[cut[i] for i in units[u]] for u in members], step=step, index=index, count=count,
                          mode=mode)
        for index, (mode, members) in enumerate(bins)
    ]
    stats.tokens = sum(lengths)
    stats.loss_tokens = sum(mb.loss_tokens for mb in batches)
    stats.micro_batches = count
    stats.padding_micro_batches = sum(1 for _, members in bins if not members)
    stats.capacity = count * seq_len
    return batches, stats
