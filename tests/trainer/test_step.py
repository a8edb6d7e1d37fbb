"""One optimizer step: the loss falls, stacked and split micro-batches give the same update, per-mode metrics."""

import pytest
import torch

from tests.trainer.helpers import (
    assert_same_gradients,
    micro_batch,
    run_step,
    setup_policy,
    step_batches,
    step_gradients,
)

torch.set_num_threads(1)


def test_one_step_lowers_the_loss_of_a_fixed_batch():
    policy, opt, sched = setup_policy(lr=1e-2)
    mbs = [micro_batch(1, 0, 1, [(3, 12), (2, 10)], mode="sft")]
    first = run_step(policy, opt, sched, mbs)
    second = run_step(policy, opt, sched, [mb.replace(step=2) for mb in mbs], step=2)
    assert second["loss/sft"] < first["loss/sft"] - 1e-3
    for key in ("entropy", "grad_norm", "lr", "tokens_per_s", "masked_fraction", "step_time_s"):
        assert key in first
    assert "mismatch_kl" not in first  # sft tokens were not sampled from the policy's server: no mismatch to report


@pytest.mark.parametrize("forward_batch", [2, 3])
def test_stacked_forward_passes_give_the_same_update(forward_batch):
    # mixed modes, unequal lengths (rows get padded), several samples per micro-batch
    mbs = step_batches(1, count=4, seed=5)
    m1, g1 = step_gradients(mbs)
    m2, g2 = step_gradients(mbs, forward_batch=forward_batch)
    for key in ("loss/rl", "loss/opd", "loss/sft", "entropy", "mismatch_kl_all", "tokens", "grad_norm"):
        assert abs(m1[key] - m2[key]) < 1e-5, key
    assert_same_gradients(g1, g2)


def test_split_micro_batches_normalise_like_one_packed_batch():
    lengths = [(3, 7), (2, 5), (4, 9)]
    whole = [micro_batch(1, 0, 1, lengths, mode="rl", seed=3)]
    # the same three samples split over two micro-batches
    a = whole[0]
    cut = 10 + 7
    split = [
        a.replace(index=i, count=2, **{f: getattr(a, f)[sl] for f in (
            "input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "temperatures")},
            sample_lengths=a.sample_lengths[sn], policy_versions=a.policy_versions[sn], rewards=a.rewards[sn])
        for i, (sl, sn) in enumerate([(slice(0, cut), slice(0, 2)), (slice(cut, None), slice(2, None))])
    ]
    m1, g1 = step_gradients(whole)
    m2, g2 = step_gradients(split)
    assert abs(m1["loss/rl"] - m2["loss/rl"]) < 1e-6
    assert abs(m1["grad_norm"] - m2["grad_norm"]) < 1e-5
    assert_same_gradients(g1, g2)


def test_mixed_modes_report_each_mode_and_on_policy_kl():
    policy, opt, sched = setup_policy()
    metrics = run_step(policy, opt, sched, step_batches(1, 4))
    assert {"loss/rl", "loss/sft", "loss/opd"} <= set(metrics)
    assert metrics["mismatch_kl"] >= 0 and 0 <= metrics["masked_fraction"] <= 1


def test_a_non_finite_gradient_is_never_stepped_on():
    policy, opt, sched = setup_policy(lr=1e-2)
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    poisoned = micro_batch(1, 0, 1, [(3, 12), (2, 10)])
    poisoned.inference_logprobs = poisoned.inference_logprobs.copy()
    poisoned.inference_logprobs[5] = float("nan")  # past the wire's check: what a bug upstream would do
    metrics = run_step(policy, opt, sched, [poisoned])
    assert metrics["skipped_nonfinite"] == 1.0
    assert all(torch.equal(before[name], p) for name, p in policy.named_parameters())
    metrics = run_step(policy, opt, sched, [micro_batch(2, 0, 1, [(3, 12)])], step=2)
    assert metrics["skipped_nonfinite"] == 0.0
    assert not all(torch.equal(before[name], p) for name, p in policy.named_parameters())


@pytest.mark.parametrize("forward_batch", [1, 2])
def test_kl_penalty_shifts_each_rl_advantage_by_the_reference_log_ratio(forward_batch):
    from tests.trainer.helpers import CPU, tiny_lm
    from trainer.logprobs import PolicyModel
    from trainer.step import to_batch

    mbs = [micro_batch(1, i, 2, [(3, 6), (2, 5)], mode="rl", seed=7) for i in range(2)]
    coef = 0.5
    same = PolicyModel(tiny_lm(0), chunk_size=16).eval()  # the policy's own initial weights
    m0, g0 = step_gradients(mbs, forward_batch=forward_batch)
    m1, g1 = step_gradients(mbs, forward_batch=forward_batch, reference=same, kl_penalty_coef=coef)
    assert m1["kl_ref"] == pytest.approx(0.0, abs=1e-6) and "kl_ref" not in m0
    assert_same_gradients(g0, g1)

    other = PolicyModel(tiny_lm(1), chunk_size=16).eval()
    m2, g2 = step_gradients(mbs, forward_batch=forward_batch, reference=other, kl_penalty_coef=coef)
    policy = PolicyModel(tiny_lm(0), chunk_size=16)
    shifted = []
    with torch.no_grad():
        for mb in mbs:
            b = to_batch(mb, CPU, 1)
            lp = policy(b.input_ids, b.position_ids, b.temperatures).logprobs
            ref = other(b.input_ids, b.position_ids, b.temperatures).logprobs
            adv = mb.advantages - coef * (lp - ref).numpy()
            shifted.append(mb.replace(advantages=adv.astype("float32")))
    m3, g3 = step_gradients(shifted, forward_batch=forward_batch)
    assert m2["kl_ref"] != 0 and m2["loss/rl"] == pytest.approx(m3["loss/rl"], rel=1e-5)
    assert_same_gradients(g2, g3, atol=1e-5)


@pytest.mark.parametrize("forward_batch", [1, 2])
def test_an_entropy_bonus_alone_raises_the_entropy_and_leaves_other_modes_alone(forward_batch):
    rl = [micro_batch(1, i, 2, [(3, 8), (2, 6)], mode="rl", seed=3) for i in range(2)]
    flat = [mb.replace(advantages=mb.advantages * 0) for mb in rl]  # no policy-gradient signal
    policy, opt, sched = setup_policy(lr=1e-2, entropy_grad=True)
    entropies = [run_step(policy, opt, sched, [mb.replace(step=s) for mb in flat], step=s,
                          forward_batch=forward_batch, entropy_coef=1.0)["entropy"] for s in range(1, 6)]
    assert entropies[-1] > entropies[0] + 1e-3, entropies
    sft = [micro_batch(1, 0, 1, [(3, 8)], mode="sft", seed=4)]
    _, g0 = step_gradients(sft, forward_batch=forward_batch)
    _, g1 = step_gradients(sft, forward_batch=forward_batch, entropy_grad=True, entropy_coef=1.0)
    assert_same_gradients(g0, g1)
    with pytest.raises(RuntimeError, match="entropy_grad=True"):
        step_gradients(rl, forward_batch=forward_batch, entropy_coef=1.0)
