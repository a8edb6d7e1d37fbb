"""Per-token losses of the three training modes (rl, opd, sft).

Every loss function maps :class:`LossInputs` (``[T]`` tensors of one micro-batch) to
:class:`LossTerms`: a per-token loss ``[T]`` and a ``[T]`` bool of tokens the loss masked out.
The step sums each mode's per-token loss over its loss tokens and divides by that mode's
loss-token count for the whole step (all micro-batches, all ranks); see :func:`reduce_loss`.

Notation: ``logπ`` trainer logprob (differentiable), ``logμ`` inference logprob of the sampled
token, ``lr = logπ − logμ``, ``r = exp(lr)``, ``A`` the advantage, ``sg`` stop-gradient.

- ``dppo`` (default rl loss, prime-rl; masking from "Decoupled PPO"-style probability-difference
  trust regions): mask a token when ``A > 0 and Δp > δ_high`` or ``A ≤ 0 and Δp < −δ_low`` with
  ``Δp = exp(logπ) − exp(logμ)``; loss ``−keep · adv_tau · A · r + kl_tau · lr²``.
- ``cispo`` (MiniMax-M1, arXiv:2506.13585): ``−sg(clip(r, 1−ε_low, 1+ε_high)) · A · logπ + kl_tau · lr²``.
- ``ppo`` (Schulman et al. 2017, arXiv:1707.06347): ``−min(r·A, clip(r, 1−ε_low, 1+ε_high)·A) + kl_tau · lr²``.
- ``opd`` (on-policy distillation, Agarwal et al. 2023, arXiv:2306.13649, prime-rl's form): the dppo
  form with ``A := sg(logπ_teacher − logπ)`` per token, adv_tau 1, masks 0.2, plus ``1e-3 · lr²``.
- ``sft``: masked negative log-likelihood ``−logπ``.
- ``custom``: ``package.module:function(inputs: LossInputs, **kwargs) -> LossTerms`` for rl batches.
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from bus.errors import ConfigError
from trainer.config import CispoLossConfig, CustomLossConfig, DppoLossConfig, LossConfig, PpoLossConfig


@dataclass
class LossInputs:
    """One micro-batch's per-token tensors, all ``[T]``."""

    logprobs: Tensor
    """fp32 trainer logprobs logπ (differentiable)."""
    inference_logprobs: Tensor
    """fp32 inference logprobs logμ of the sampled tokens."""
    advantages: Tensor
    """fp32 advantage A of each token's sample."""
    loss_mask: Tensor
    """bool, True on tokens that count in the loss."""
    teacher_logprobs: Tensor | None = None
    """fp32 teacher logprobs (opd)."""


@dataclass
class LossTerms:
    """What a loss function returns."""

    loss: Tensor
    """``[T]`` per-token loss (only loss-mask tokens are summed)."""
    masked: Tensor
    """``[T]`` bool: tokens whose policy-gradient term the loss masked or clipped (for the masked fraction)."""


LossFn = Callable[[LossInputs], LossTerms]


def dppo_loss(
    inputs: LossInputs, adv_tau: float = 1.0, kl_tau: float = 1e-3, dppo_mask_low: float = 0.2,
    dppo_mask_high: float = 0.2,
) -> LossTerms:
    """prime-rl's default: probability-difference masked importance-weighted policy gradient + kl_tau · lr²."""
    return _dppo(inputs, inputs.advantages, adv_tau, kl_tau, dppo_mask_low, dppo_mask_high)


def _dppo(inputs: LossInputs, adv: Tensor, adv_tau: float, kl_tau: float, low: float, high: float) -> LossTerms:
    log_ratio = inputs.logprobs - inputs.inference_logprobs
    with torch.no_grad():
        prob_diff = inputs.logprobs.exp() - inputs.inference_logprobs.exp()
        masked = ((adv > 0) & (prob_diff > high)) | ((adv <= 0) & (prob_diff < -low))
    keep = (~masked).to(log_ratio.dtype)
    loss = -keep * adv_tau * adv * log_ratio.exp() + kl_tau * log_ratio.square()
    return LossTerms(loss=loss, masked=masked)


def cispo_loss(inputs: LossInputs, eps_low: float = 0.2, eps_high: float = 0.28, kl_tau: float = 0.0) -> LossTerms:
    """CISPO: clipped importance weight (no gradient) times A times logπ, so clipped tokens still get gradient."""
    log_ratio = inputs.logprobs - inputs.inference_logprobs
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(1 - eps_low, 1 + eps_high)
    masked = weight != ratio
    loss = -weight * inputs.advantages * inputs.logprobs + kl_tau * log_ratio.square()
    return LossTerms(loss=loss, masked=masked)


def ppo_loss(inputs: LossInputs, clip_low: float = 0.2, clip_high: float = 0.2, kl_tau: float = 0.0) -> LossTerms:
    """PPO's clipped surrogate, with the inference policy as the old policy."""
    log_ratio = inputs.logprobs - inputs.inference_logprobs
    ratio = log_ratio.exp()
    adv = inputs.advantages
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    masked = (clipped < unclipped).detach()
    loss = -torch.minimum(unclipped, clipped) + kl_tau * log_ratio.square()
    return LossTerms(loss=loss, masked=masked)


def opd_loss(inputs: LossInputs) -> LossTerms:
    """On-policy distillation: the dppo form with A = sg(logπ_teacher − logπ); knobs fixed as in prime-rl."""
    if inputs.teacher_logprobs is None:
        raise ValueError("an opd micro-batch has no teacher_logprobs; "
                         "the rollout must fetch teacher logprobs in opd mode")
    adv = (inputs.teacher_logprobs - inputs.logprobs).detach()
    return _dppo(inputs, adv, adv_tau=1.0, kl_tau=1e-3, low=0.2, high=0.2)


def sft_loss(inputs: LossInputs) -> LossTerms:
    """Masked negative log-likelihood."""
    return LossTerms(loss=-inputs.logprobs, masked=torch.zeros_like(inputs.loss_mask))


def rl_loss_fn(cfg: LossConfig) -> LossFn:
    """The rl-mode loss chosen by ``[trainer.loss]``."""
    if isinstance(cfg, DppoLossConfig):
        return partial(dppo_loss, adv_tau=cfg.adv_tau, kl_tau=cfg.kl_tau, dppo_mask_low=cfg.dppo_mask_low,
                       dppo_mask_high=cfg.dppo_mask_high)
    if isinstance(cfg, CispoLossConfig):
        return partial(cispo_loss, eps_low=cfg.eps_low, eps_high=cfg.eps_high, kl_tau=cfg.kl_tau)
    if isinstance(cfg, PpoLossConfig):
        return partial(ppo_loss, clip_low=cfg.clip_low, clip_high=cfg.clip_high, kl_tau=cfg.kl_tau)
    if isinstance(cfg, CustomLossConfig):
        return partial(_import(cfg.import_path), **cfg.kwargs)
    raise ConfigError(f"unknown trainer.loss type {cfg!r}")


def _import(path: str) -> Callable:
    module_name, sep, attr = path.partition(":")
    if not sep:
        raise ConfigError(f"trainer.loss.import_path={path!r} needs the form 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"trainer.loss.import_path={path!r} cannot be imported: {e}") from e
    if not callable(fn):
        raise ConfigError(f"trainer.loss.import_path={path!r} is not callable")
    return fn


def loss_fns(cfg: LossConfig) -> dict[str, LossFn]:
    """Loss function per mode: rl from the config, opd and sft fixed."""
    return {"rl": rl_loss_fn(cfg), "opd": opd_loss, "sft": sft_loss}


def reduce_loss(terms: LossTerms, loss_mask: Tensor, mode_tokens: float) -> Tensor:
    """Σ over loss tokens of the per-token loss, divided by the mode's loss-token count for the whole step."""
    return torch.where(loss_mask, terms.loss, 0.0).sum() / max(mode_tokens, 1.0)
