"""The rows of one forward pass over micro-batches whose samples share prompts: each micro-batch cut into its
independent segments, the segments packed into rows as wide as the longest one.

A segment is a sample that holds its own prompt and the samples after it that read that prompt
(``MicroBatch.shared_prompt_lengths``): no token attends outside its segment. A micro-batch packs several segments
into one long sequence, and attending over it costs the square of its length; cut into rows of at most the longest
segment, the same tokens cost the sum of the rows' squares (a 1024-token micro-batch of four 240-token groups:
a third of the trainer step on the CPU). The rows are laid out by :func:`~trainer.logprobs.packed_layout`, each
row's padding a sample of its own; :attr:`Rows.index` maps every micro-batch's tokens back to their place in the rows.
"""

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from trainer.logprobs import packed_layout


@dataclass
class Segment:
    """Tokens ``[start, end)`` of micro-batch ``batch``: its samples' lengths and shared prompt lengths."""

    batch: int
    start: int
    end: int
    lengths: list[int]
    shared: list[int]


@dataclass
class Rows:
    """A ``[R, W]`` batch for :class:`~trainer.logprobs.PolicyModel` and where each micro-batch's tokens went."""

    input_ids: Tensor
    position_ids: Tensor
    temperatures: Tensor
    attention_mask: Tensor
    """``[R, W, W]`` bool."""
    sources: Tensor
    """``[R, W]``."""
    index: list[Tensor]
    """Per micro-batch, ``[T]`` int64: token t's place ``r * W + c`` in the flattened rows."""

    def inputs(self) -> tuple[Tensor, ...]:
        return self.input_ids, self.position_ids, self.temperatures, self.attention_mask, self.sources


def segments(batch: int, lengths: np.ndarray, shared: np.ndarray | None) -> list[Segment]:
    """The segments of one micro-batch, in order (with no shared prompts, each sample is one)."""
    shared = np.zeros_like(lengths) if shared is None else shared
    out: list[Segment] = []
    start = 0
    for length, reads in zip(lengths.tolist(), shared.tolist(), strict=True):
        if reads == 0 or not out:
            out.append(Segment(batch, start, start, [], []))
        segment = out[-1]
        segment.lengths.append(length)
        segment.shared.append(reads)
        segment.end += length
        start += length
    return out


def pack_segments(parts: list[Segment]) -> tuple[int, list[list[Segment]]]:
    """First-fit decreasing into rows of the longest segment's width: (width, rows)."""
    width = max(p.end - p.start for p in parts)
    rows: list[list[Segment]] = []
    room: list[int] = []
    for part in sorted(parts, key=lambda p: p.start - p.end):
        size = part.end - part.start
        fit = next((r for r, left in enumerate(room) if left >= size), None)
        if fit is None:
            rows.append([])
            room.append(width)
            fit = len(rows) - 1
        rows[fit].append(part)
        room[fit] -= size
    return width, rows


def lay_out(input_ids: list[Tensor], position_ids: list[Tensor], temperatures: list[Tensor],
            lengths: list[np.ndarray], shared: list[np.ndarray | None]) -> Rows:
    """The rows of micro-batches given by their ``[T]`` tensors, sample lengths and shared prompt lengths."""
    parts = [s for b, (n, p) in enumerate(zip(lengths, shared, strict=True)) for s in segments(b, n, p)]
    width, rows = pack_segments(parts)
    device = input_ids[0].device
    offsets = np.cumsum([0] + [len(ids) for ids in input_ids])  # each micro-batch's place in their concatenation
    gather = np.full(len(rows) * width, -1, dtype=np.int64)
    """Per row slot: the token of the concatenation it holds, −1 for padding."""
    used = np.zeros(len(rows), dtype=np.int64)
    row_lengths: list[int] = []
    row_shared: list[int] = []
    for r, row in enumerate(rows):
        for part in row:
            place = r * width + used[r]
            gather[place:place + part.end - part.start] = np.arange(offsets[part.batch] + part.start,
                                                                    offsets[part.batch] + part.end)
            used[r] += part.end - part.start
            row_lengths += part.lengths
            row_shared += part.shared
        if used[r] < width:  # the padding: a sample of its own, positions from 0
            row_lengths.append(width - int(used[r]))
            row_shared.append(0)
    pad = gather < 0
    place = torch.from_numpy(np.where(pad, 0, gather)).to(device)
    pad_t = torch.from_numpy(pad).to(device)
    pad_pos = torch.from_numpy((np.arange(width)[None, :] - used[:, None]).reshape(-1)).to(device)
    ids = torch.cat(input_ids)[place].masked_fill_(pad_t, 0)
    pos = torch.where(pad_t, pad_pos, torch.cat(position_ids)[place])
    temps = torch.cat(temperatures)[place].masked_fill_(pad_t, 1.0)
    mask, sources = packed_layout(torch.tensor(row_lengths, device=device), torch.tensor(row_shared, device=device),
                                  width)
    slot_of = np.empty(offsets[-1], dtype=np.int64)
    slot_of[gather[~pad]] = np.flatnonzero(~pad)
    index = [torch.from_numpy(slot_of[offsets[b]:offsets[b + 1]]).to(device) for b in range(len(input_ids))]
    return Rows(ids.view(len(rows), width), pos.view(len(rows), width), temps.view(len(rows), width).float(), mask,
                sources, index)
