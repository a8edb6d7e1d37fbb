"""Group-relative advantages (GRPO): ``A_i = r_i − mean(r)`` over the samples of one group.

Options (``[filter.advantage]``): a length penalty subtracted from each reward before centring,
and division by the group's standard deviation (off by default, as in Dr. GRPO). A group of one
sample has no baseline, so its advantage is 0.
"""

import numpy as np

from bus.messages import Sample
from workers.batch_config import AdvantageConfig

STD_EPS = 1e-6
"""Added to the group std before dividing, so near-constant groups do not blow up."""


def group_advantages(
    rewards: np.ndarray,
    completion_tokens: np.ndarray,
    cfg: AdvantageConfig,
    max_completion_tokens: int | None,
) -> np.ndarray:
    """Advantages of one group (float32, same length as ``rewards``).

    ``completion_tokens`` are the model-sampled tokens of each sample; the length penalty is
    ``length_penalty × tokens / max_completion_tokens`` (None: the group's longest completion).
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.size <= 1:
        return np.zeros(rewards.size, dtype=np.float32)
    shaped = rewards
    if cfg.length_penalty:
        tokens = np.asarray(completion_tokens, dtype=np.float64)
        scale = max_completion_tokens if max_completion_tokens else max(float(tokens.max()), 1.0)
        shaped = rewards - cfg.length_penalty * tokens / scale
    centred = shaped - shaped.mean()
    if cfg.std_normalize:
        centred = centred / (shaped.std() + STD_EPS)
    return centred.astype(np.float32)


def assign_advantages(
    samples: list[Sample], cfg: AdvantageConfig, max_completion_tokens: int | None
) -> np.ndarray:
    """Compute the group's advantages and write each into ``sample.advantage``; returns them."""
    rewards = np.array([s.reward for s in samples], dtype=np.float64)
    tokens = np.array([int(s.loss_mask.sum()) for s in samples], dtype=np.int64)
    advantages = group_advantages(rewards, tokens, cfg, max_completion_tokens)
    if not np.isfinite(advantages).all():
        raise ValueError(
            f"advantages {advantages.tolist()} are not finite (rewards {rewards.tolist()} overflow float32)")
    for sample, advantage in zip(samples, advantages, strict=True):
        sample.advantage = float(advantage)
    return advantages


def zero_variance(rewards: list[float] | np.ndarray, tol: float = 1e-12) -> bool:
    """True when a group of at least two samples has identical rewards (no learning signal)."""
    values = np.asarray(rewards, dtype=np.float64)
    return values.size >= 2 and float(values.max() - values.min()) <= tol
