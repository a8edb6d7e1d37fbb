"""The rows of one forward pass over micro-batches whose samples share prompts: each micro-batch cut into its
independent segments, the segments packed into rows as wide as the longest one.

A segment is a sample that holds its own prompt and the samples after it that read that prompt
(``MicroBatch.shared_prompt_lengths``): no token attends outside its segment. A micro-batch packs several segments
into one long sequence, and attending over it costs the square of its length; cut into rows of at most the longest
segment, the same tokens cost the sum of the rows' squares (a 1024-token micro-batch of four 240-token groups:
a third of the trainer step on the CPU). Each row is laid out by :func:`~trainer.logprobs.packed_layout`, its
padding a sample of its own; :attr:`Rows.index` maps every micro-batch's tokens back to their place in the rows.
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
    flat = [np.empty(len(ids), dtype=np.int64) for ids in input_ids]
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    pos = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    temps = torch.ones(len(rows), width, dtype=torch.float32, device=device)
    masks, sources = [], []
    for r, row in enumerate(rows):
        at, row_lengths, row_shared = 0, [], []
        for part in row:
            size = part.end - part.start
            ids[r, at:at + size] = input_ids[part.batch][part.start:part.end]
            pos[r, at:at + size] = position_ids[part.batch][part.start:part.end]
            temps[r, at:at + size] = temperatures[part.batch][part.start:part.end]
            flat[part.batch][part.start:part.end] = np.arange(r * width + at, r * width + at + size)
            row_lengths += part.lengths
            row_shared += part.shared
            at += size
        if at < width:  # the padding: a sample of its own, positions from 0
            pos[r, at:] = torch.arange(width - at, device=device)
            row_lengths.append(width - at)
            row_shared.append(0)
        mask, source = packed_layout(torch.tensor(row_lengths, device=device),
                                     torch.tensor(row_shared, device=device))
        masks.append(mask)
        sources.append(source)
    index = [torch.from_numpy(f).to(device) for f in flat]
    return Rows(ids, pos, temps, torch.stack(masks), torch.stack(sources), index)
