"""Trainer pieces on a tiny Qwen3: logprobs, one step, normalisation, weights, broadcast, FSDP, checkpoints."""

import multiprocessing as mp

import pytest
import torch
from trainer_helpers import fsdp_rank_step, micro_batch, step_batches, tiny_lm

from trainer.config import CkptConfig, DppoLossConfig, TrainerConfig
from trainer.dist import DistContext
from trainer.logprobs import PolicyModel
from trainer.losses import loss_fns
from trainer.optim import build_optimizer, build_scheduler, lr_factor
from trainer.step import to_batch, train_step

torch.set_num_threads(1)
CPU = torch.device("cpu")


def setup_policy(lr=1e-2, seed=0, **cfg):
    policy = PolicyModel(tiny_lm(seed), chunk_size=16)
    tcfg = TrainerConfig(lr=lr, **cfg)
    opt = build_optimizer(policy, tcfg)
    return policy, opt, build_scheduler(opt, tcfg, 10)


def step_gradients(mbs, forward_batch=1):
    """Metrics and the (clipped) gradients AdamW is handed in one step. Compare gradients, not updated weights:
    AdamW's first update is ≈ lr·sign(g), so float-rounding noise on a near-zero gradient moves a weight by ~lr."""
    policy, opt, sched = setup_policy()
    grads = {}

    def record(_optimizer, _args, _kwargs):
        grads.update({name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None})

    opt.register_step_pre_hook(record)
    return run_step(policy, opt, sched, mbs, forward_batch=forward_batch), grads


def assert_same_gradients(a, b, atol=1e-6):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=atol), name


def run_step(policy, opt, sched, mbs, step=1, forward_batch=1):
    batches = [to_batch(mb, CPU, step) for mb in mbs]
    return train_step(policy, opt, sched, batches, loss_fns=loss_fns(DppoLossConfig()), ctx=DistContext(), step=step,
                      max_grad_norm=1.0, forward_batch=forward_batch)


def test_packed_logprobs_equal_unpacked():
    policy = PolicyModel(tiny_lm(), chunk_size=5)
    mb = micro_batch(1, 0, 1, [(4, 9), (3, 6), (2, 11)], temperature=0.8)
    b = to_batch(mb, CPU, 1)
    with torch.no_grad():
        packed = policy(b.input_ids, b.position_ids, b.temperatures)
        start, pieces, ents = 0, [], []
        for n in mb.sample_lengths.tolist():
            sl = slice(start, start + n)
            one = policy(b.input_ids[sl], b.position_ids[sl], b.temperatures[sl])
            pieces.append(one.logprobs)
            ents.append(one.entropy)
            start += n
    assert torch.allclose(packed.logprobs, torch.cat(pieces), atol=1e-5, rtol=0)
    assert torch.allclose(packed.entropy, torch.cat(ents), atol=1e-5, rtol=0)


def test_chunked_logprobs_and_grads_match_full_logits_with_temperature():
    lm = tiny_lm()
    policy = PolicyModel(lm, chunk_size=3)
    ids = torch.randint(0, 300, (17,))
    temps = torch.full((17,), 0.6)
    weights = torch.randn(17)
    out = policy(ids, torch.arange(17), temps)
    (out.logprobs * weights).sum().backward()
    chunked_grads = [p.grad.clone() for p in lm.parameters()]
    lm.zero_grad()
    logp = torch.log_softmax(lm(input_ids=ids[None]).logits[0, :-1].float() / 0.6, -1)
    ref = logp.gather(-1, ids[1:, None])[:, 0]
    (ref * weights[1:]).sum().backward()
    assert torch.allclose(out.logprobs[1:], ref, atol=1e-5)
    assert torch.allclose(out.entropy[1:], -(logp.exp() * logp).sum(-1), atol=1e-5)
    for got, want in zip(chunked_grads, [p.grad for p in lm.parameters()], strict=True):
        assert torch.allclose(got, want, atol=1e-5)


def test_one_step_lowers_the_loss_of_a_fixed_batch():
    policy, opt, sched = setup_policy(lr=1e-2)
    mbs = [micro_batch(1, 0, 1, [(3, 12), (2, 10)], mode="sft")]
    first = run_step(policy, opt, sched, mbs)
    second = run_step(policy, opt, sched, [mb.model_copy(update={"step": 2}) for mb in mbs], step=2)
    assert second["loss/sft"] < first["loss/sft"] - 1e-3
    for key in ("entropy", "grad_norm", "lr", "tokens_per_s", "masked_fraction", "mismatch_kl", "step_time_s"):
        assert key in first


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
        a.model_copy(update=dict(index=i, count=2, **{f: getattr(a, f)[sl] for f in (
            "input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "temperatures")},
            sample_lengths=a.sample_lengths[sn], policy_versions=a.policy_versions[sn], rewards=a.rewards[sn]))
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


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainerConfig(lr=1.0, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    assert [round(lr_factor(s, cfg, 6), 4) for s in range(7)] == [0.5, 1.0, 1.0, 0.8682, 0.55, 0.2318, 0.1]


def test_fsdp_two_gloo_ranks_match_one_rank(tmp_path):
    from trainer.dist import spawn

    out = tmp_path / "fsdp.pt"
    spawn(2, fsdp_rank_step, (str(out), 4))
    two = torch.load(out, weights_only=False)
    policy, opt, sched = setup_policy(lr=1e-2, seed=0)
    opt = build_optimizer(policy, TrainerConfig(lr=1e-2))
    sched = build_scheduler(opt, TrainerConfig(lr=1e-2), None)
    one = run_step(policy, opt, sched, step_batches(1, 4))
    assert abs(one["loss"] - two["metrics"]["loss"]) < 1e-5
    for name, tensor in policy.lm.state_dict().items():
        assert torch.allclose(tensor, two["state"][name], atol=1e-5), name


def test_checkpoint_round_trip_restores_optimizer_and_schedule(tmp_path):
    from trainer.checkpoint import Checkpointer

    ckpt = Checkpointer(tmp_path, CkptConfig(interval=1, keep_last=2, keep_interval=2), DistContext())
    policy, opt, sched = setup_policy(warmup_steps=3)
    for step in (1, 2, 3):
        run_step(policy, opt, sched, step_batches(step, 2), step=step)
        ckpt.save(step, policy, opt, sched)
    assert ckpt.steps() == [2, 3]  # keep_last 2; step 2 also a keep_interval multiple
    assert ckpt.resolve(-1) == 3 and ckpt.resolve(None) is None
    restored, opt2, sched2 = setup_policy(seed=5, warmup_steps=3)
    ckpt.load(3, restored, opt2, sched2)
    a = run_step(policy, opt, sched, step_batches(4, 2), step=4)
    b = run_step(restored, opt2, sched2, step_batches(4, 2), step=4)
    assert a["lr"] == b["lr"]
    for x, y in zip(policy.parameters(), restored.parameters(), strict=True):
        assert torch.equal(x, y)
    from bus.errors import ConfigError

    with pytest.raises(ConfigError, match="resume_step=7"):
        ckpt.resolve(7)


def test_save_and_load_weights_round_trip(tmp_path):
    from trainer.weights import (
        load_weights_into,
        prune_weights,
        read_weights,
        save_weights,
        verify_weights,
        weights_dir,
    )

    src = tiny_lm(seed=1)
    dst = tiny_lm(seed=2)
    files = save_weights(src, weights_dir(tmp_path, 1), max_shard_mb=1)
    small = save_weights(src, weights_dir(tmp_path, 2), max_shard_mb=1)
    assert [f.name for f in files] == [f.name for f in small]
    verify_weights(weights_dir(tmp_path, 1), files)
    assert "lm.lm_head.weight" not in read_weights(weights_dir(tmp_path, 1))
    assert "lm_head.weight" not in read_weights(weights_dir(tmp_path, 1))  # tied: stored once
    load_weights_into(dst, weights_dir(tmp_path, 1))
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        assert torch.equal(src(input_ids=ids).logits, dst(input_ids=ids).logits)
    assert dst.lm_head.weight is dst.model.embed_tokens.weight
    for step in (3, 4, 5):
        save_weights(src, weights_dir(tmp_path, step), 1)
    assert prune_weights(tmp_path, keep=2, protected={1}) == [2, 3]


def test_save_weights_shards_and_untied_head(tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer.weights import load_weights_into, save_weights, verify_weights

    src = tiny_lm(seed=1, tie=False)
    state = src.state_dict()
    assert "lm_head.weight" in state
    files = save_weights(state, tmp_path / "w2", max_shard_mb=0.1, config=src.config)
    assert len(files) > 2 and files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    assert all(f.bytes <= 0.1 * 2**20 + 2**16 for f in files)
    verify_weights(tmp_path / "w2", files)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "w2")  # a plain HF folder
    dst = tiny_lm(seed=3, tie=False)
    load_weights_into(dst, tmp_path / "w2")
    for (n, a), b in zip(src.state_dict().items(), reloaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), n


def _receive(fields, queue):
    torch.set_num_threads(1)
    from bus.messages import WeightUpdate
    from trainer.broadcast import receive_weights

    got = receive_weights(WeightUpdate.from_fields(fields), "cpu", timeout_s=60)
    queue.put({k: v.numpy() for k, v in got.items()})  # numpy: plain pickling, no fd sharing


def test_gloo_broadcast_reaches_a_receiver_in_another_process():
    from bus.local_redis import free_port
    from trainer.broadcast import WeightBroadcaster

    state = tiny_lm(seed=4).state_dict()
    sender = WeightBroadcaster("127.0.0.1", free_port(), receivers=1, device=CPU, timeout_s=60)
    spawn_ctx = mp.get_context("spawn")
    for step in (1, 2):
        event = sender.event(step, state)
        assert "lm_head.weight" not in [t.name for t in event.tensors]
        queue = spawn_ctx.Queue()
        proc = spawn_ctx.Process(target=_receive, args=(event.to_fields(), queue))
        proc.start()
        sender.broadcast(event, state)
        got = queue.get(timeout=60)
        proc.join(timeout=30)
        assert set(got) == {t.name for t in event.tensors}
        for name, tensor in got.items():
            assert torch.equal(torch.from_numpy(tensor), state[name])
