"""Sample filters: prime-rl's gibberish, repetition and zero advantage, and DAPO's truncated (overlong).

Each filter flags samples; an ``enforce`` filter drops the flagged ones, a monitor-only filter
just annotates them (``sample.flags[type] = True``) and counts. Advantages are computed before
any filter runs, so a dropped sample's reward still counted in its group's baseline.
"""

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bus.errors import ConfigError
from bus.messages import Sample
from workers.batch_config import (
    GibberishFilterConfig,
    RepetitionFilterConfig,
    SampleFilterConfig,
    TruncatedFilterConfig,
    ZeroAdvantageFilterConfig,
)


def model_vocab_size(model_path: str) -> int:
    """``vocab_size`` of the model (its config.json), needed by the gibberish filter."""
    config_file = Path(model_path) / "config.json"
    if config_file.exists():
        return int(json.loads(config_file.read_text())["vocab_size"])
    from transformers import AutoConfig

    try:
        return int(AutoConfig.from_pretrained(model_path).vocab_size)
    except OSError as e:
        raise ConfigError(
            f"model.path={model_path!r} has no config.json; point model.path at a model folder"
        ) from e


def is_gibberish(sample: Sample, cfg: GibberishFilterConfig, vocab_size: int) -> bool:
    """Any sampled token with id > token_id_threshold and logprob < −ln(vocab_size) − logprob_offset."""
    mask = sample.loss_mask
    ids = sample.completion_ids[mask]
    logprobs = sample.completion_logprobs[mask]
    threshold = -math.log(vocab_size) - cfg.logprob_offset
    return bool(np.any((ids > cfg.token_id_threshold) & (logprobs < threshold)))


def longest_run(flags: np.ndarray) -> int:
    """Length of the longest run of True in a 1-D bool array."""
    if flags.size == 0 or not flags.any():
        return 0
    padded = np.concatenate(([False], flags, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return int((edges[1::2] - edges[0::2]).max())


def is_repetitive(sample: Sample, cfg: RepetitionFilterConfig) -> bool:
    """At least ``window`` consecutive sampled tokens each drawn with probability > prob_threshold.

    Environment tokens (loss_mask False) are skipped: the run is over the model's own tokens.
    """
    logprobs = sample.completion_logprobs[sample.loss_mask]
    confident = logprobs > math.log(cfg.prob_threshold)
    return longest_run(confident) >= cfg.window


def is_zero_advantage(sample: Sample) -> bool:
    """The sample's advantage is exactly 0 (its group gave no learning signal)."""
    return sample.advantage == 0.0


def flag(sample: Sample, cfg: SampleFilterConfig, vocab_size: int) -> bool:
    """Whether filter ``cfg`` flags ``sample``."""
    if isinstance(cfg, GibberishFilterConfig):
        return is_gibberish(sample, cfg, vocab_size)
    if isinstance(cfg, RepetitionFilterConfig):
        return is_repetitive(sample, cfg)
    if isinstance(cfg, ZeroAdvantageFilterConfig):
        return is_zero_advantage(sample)
    if isinstance(cfg, TruncatedFilterConfig):
        return sample.is_truncated
    raise TypeError(f"unknown filter config {type(cfg).__name__}")


@dataclass
class FilterCounts:
    """What a filter pass saw: samples seen, flagged and dropped per filter type."""

    seen: int = 0
    flagged: Counter = field(default_factory=Counter)
    dropped: Counter = field(default_factory=Counter)

    def add(self, other: "FilterCounts") -> None:
        self.seen += other.seen
        self.flagged.update(other.flagged)
        self.dropped.update(other.dropped)

    def metrics(self, prefix: str) -> dict[str, float]:
        """Metric values ``{prefix}/{type}/flagged`` and ``{prefix}/{type}/dropped`` (every configured type)."""
        out: dict[str, float] = {f"{prefix}/seen": float(self.seen)}
        for name in sorted(set(self.flagged) | set(self.dropped)):
            out[f"{prefix}/{name}/flagged"] = float(self.flagged[name])
            out[f"{prefix}/{name}/dropped"] = float(self.dropped[name])
        return out


def active_filters(filters: list[SampleFilterConfig], mode: str) -> list[SampleFilterConfig]:
    """The filters that apply to a group of ``mode``: zero_advantage only to rl groups (others have no advantage)."""
    if mode == "rl":
        return filters
    return [f for f in filters if f.type != "zero_advantage"]


def apply_filters(
    samples: list[Sample], filters: list[SampleFilterConfig], vocab_size: int
) -> tuple[list[Sample], FilterCounts]:
    """Annotate every sample with each filter's verdict; return the samples no enforcing filter flagged.

    A sample flagged by several enforcing filters counts as dropped by each of them.
    """
    counts = FilterCounts(seen=len(samples))
    for cfg in filters:
        counts.flagged[cfg.type] += 0
        counts.dropped[cfg.type] += 0
    kept: list[Sample] = []
    for sample in samples:
        drop = False
        for cfg in filters:
            flagged = flag(sample, cfg, vocab_size)
            sample.flags[cfg.type] = flagged
            if flagged:
                counts.flagged[cfg.type] += 1
                if cfg.enforce:
                    counts.dropped[cfg.type] += 1
                    drop = True
        if not drop:
            kept.append(sample)
    return kept, counts
