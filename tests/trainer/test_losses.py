"""Each loss against hand-computed values on tiny tensors, on both sides of every mask threshold."""

import math

import pytest
import torch

from trainer.config import CustomLossConfig, DppoLossConfig
from trainer.losses import (
    LossInputs,
    cispo_loss,
    dppo_loss,
    loss_fns,
    opd_loss,
    ppo_loss,
    reduce_loss,
    rl_loss_fn,
    sft_loss,
)

torch.set_num_threads(1)


def inputs(pi, mu, adv, teacher=None, mask=None):
    lp = torch.tensor([math.log(p) for p in pi], requires_grad=True)
    return LossInputs(
        logprobs=lp, inference_logprobs=torch.tensor([math.log(m) for m in mu]), advantages=torch.tensor(adv),
        loss_mask=torch.tensor(mask if mask is not None else [True] * len(pi)),
        teacher_logprobs=None if teacher is None else torch.tensor([math.log(t) for t in teacher]),
    )


def test_dppo_masks_on_both_sides_of_each_threshold():
    # Δp: +0.3 (A>0 masked), +0.15 (A>0 kept), +0.3 with A<0 (kept), −0.3 with A<0 (masked), −0.15 A<0 kept,
    # −0.3 A>0 kept
    pi = [0.5, 0.35, 0.5, 0.2, 0.35, 0.2]
    mu = [0.2, 0.2, 0.2, 0.5, 0.5, 0.5]
    adv = [1.0, 1.0, -1.0, -1.0, -2.0, 0.5]
    x = inputs(pi, mu, adv)
    terms = dppo_loss(x)
    assert terms.masked.tolist() == [True, False, False, True, False, False]
    expected = []
    for p, m, a, masked in zip(pi, mu, adv, terms.masked.tolist(), strict=True):
        lr = math.log(p) - math.log(m)
        expected.append(-(0.0 if masked else 1.0) * a * math.exp(lr) + 1e-3 * lr * lr)
    assert torch.allclose(terms.loss, torch.tensor(expected), atol=1e-6)


def test_dppo_zero_advantage_counts_as_non_positive():
    x = inputs([0.1], [0.4], [0.0])  # Δp = −0.3, A = 0 → masked (A ≤ 0 branch)
    assert dppo_loss(x).masked.tolist() == [True]


def test_dppo_gradient_of_masked_token_is_only_the_kl_term():
    x = inputs([0.5, 0.35], [0.2, 0.2], [1.0, 1.0])
    dppo_loss(x, kl_tau=0.0).loss.sum().backward()
    # masked token: no gradient; kept token: d(−A·exp(lp − lμ))/dlp = −A·r
    assert x.logprobs.grad[0] == 0
    assert math.isclose(float(x.logprobs.grad[1]), -0.35 / 0.2, rel_tol=1e-5)


def test_dppo_thresholds_are_configurable():
    x = inputs([0.5], [0.2], [1.0])
    assert dppo_loss(x, dppo_mask_high=0.4).masked.tolist() == [False]
    assert dppo_loss(x, dppo_mask_high=0.29).masked.tolist() == [True]


def test_cispo_clips_the_weight_but_keeps_the_gradient():
    # r = 2.5 → clipped to 1.28; r = 1.1 inside; r = 0.5 → clipped to 0.8
    x = inputs([0.5, 0.22, 0.1], [0.2, 0.2, 0.2], [1.0, -1.0, 2.0])
    terms = cispo_loss(x)
    w = [1.28, 0.22 / 0.2, 0.8]
    expected = [-wi * a * math.log(p) for wi, a, p in zip(w, [1.0, -1.0, 2.0], [0.5, 0.22, 0.1], strict=True)]
    assert torch.allclose(terms.loss, torch.tensor(expected), atol=1e-6)
    assert terms.masked.tolist() == [True, False, True]
    terms.loss.sum().backward()
    assert torch.allclose(x.logprobs.grad, torch.tensor([-1.28, 0.22 / 0.2, -1.6]), atol=1e-5)


def test_ppo_clipped_surrogate():
    # A>0 r=2.5 → clipped 1.2; A<0 r=2.5 → unclipped (pessimistic) 2.5; A>0 r=1.1 → unclipped; A<0 r=0.5 → clipped 0.8
    x = inputs([0.5, 0.5, 0.22, 0.1], [0.2, 0.2, 0.2, 0.2], [1.0, -1.0, 1.0, -1.0])
    terms = ppo_loss(x)
    assert torch.allclose(terms.loss, torch.tensor([-1.2, 2.5, -1.1, 0.8]), atol=1e-5)
    assert terms.masked.tolist() == [True, False, False, True]


def test_opd_uses_teacher_minus_student_as_advantage():
    # A = log t − log π: +ve for token 0, −ve for token 1; Δp small → kept; token 2 Δp = +0.3 with A>0 → masked
    pi, mu, teacher = [0.3, 0.3, 0.5], [0.25, 0.35, 0.2], [0.6, 0.1, 0.9]
    x = inputs(pi, mu, [9.0, 9.0, 9.0], teacher=teacher)  # MicroBatch advantages are ignored in opd
    terms = opd_loss(x)
    assert terms.masked.tolist() == [False, False, True]
    expected = []
    for p, m, t, masked in zip(pi, mu, teacher, terms.masked.tolist(), strict=True):
        lr = math.log(p / m)
        expected.append(-(0.0 if masked else 1.0) * math.log(t / p) * math.exp(lr) + 1e-3 * lr * lr)
    assert torch.allclose(terms.loss, torch.tensor(expected), atol=1e-6)
    terms.loss.sum().backward()  # A is stop-gradient: d/dlp of −A·r is −A·r
    lr0 = math.log(0.3 / 0.25)
    assert math.isclose(float(x.logprobs.grad[0]), -math.log(0.6 / 0.3) * math.exp(lr0) + 2e-3 * lr0, rel_tol=1e-5)


def test_opd_without_teacher_logprobs_explains():
    with pytest.raises(ValueError, match="teacher_logprobs"):
        opd_loss(inputs([0.5], [0.5], [0.0]))


def test_sft_is_masked_nll_normalised_by_the_step_token_count():
    x = inputs([0.5, 0.25, 0.1], [1, 1, 1], [0, 0, 0], mask=[True, True, False])
    terms = sft_loss(x)
    # summed over the mask, divided by the mode's count for the whole step (say 4 tokens over 2 micro-batches)
    got = reduce_loss(terms, x.loss_mask, mode_tokens=4)
    assert math.isclose(got.item(), (math.log(2) + math.log(4)) / 4, rel_tol=1e-6)


def test_normalisation_across_micro_batches_equals_one_big_batch():
    a = inputs([0.5, 0.25], [0.4, 0.3], [1.0, -1.0])
    b = inputs([0.7, 0.2, 0.3], [0.6, 0.1, 0.3], [0.5, 0.5, -2.0], mask=[True, False, True])
    whole = inputs([0.5, 0.25, 0.7, 0.2, 0.3], [0.4, 0.3, 0.6, 0.1, 0.3], [1.0, -1.0, 0.5, 0.5, -2.0],
                   mask=[True, True, True, False, True])
    split = reduce_loss(dppo_loss(a), a.loss_mask, 4) + reduce_loss(dppo_loss(b), b.loss_mask, 4)
    assert math.isclose(split.item(), reduce_loss(dppo_loss(whole), whole.loss_mask, 4).item(), rel_tol=1e-6)


def test_rl_loss_from_config_and_custom_import_path():
    x = inputs([0.5], [0.2], [1.0])
    fn = rl_loss_fn(DppoLossConfig(kl_tau=0.5))
    assert math.isclose(fn(x).loss.item(), 0.5 * math.log(2.5) ** 2, rel_tol=1e-6)  # masked: only the kl term
    custom = rl_loss_fn(CustomLossConfig(import_path="trainer.losses:ppo_loss", kwargs={"clip_high": 2.0}))
    assert math.isclose(custom(x).loss.item(), -2.5, rel_tol=1e-6)
    assert set(loss_fns(DppoLossConfig())) == {"rl", "opd", "sft"}


def test_custom_loss_bad_path_names_the_value():
    from bus.errors import ConfigError

    with pytest.raises(ConfigError, match="nope.module:fn"):
        rl_loss_fn(CustomLossConfig(import_path="nope.module:fn"))
