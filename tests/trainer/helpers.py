"""Tiny models and micro-batches for the trainer tests (no tokenizer needed)."""

import os
from pathlib import Path

import numpy as np
import torch

from bus.messages import MicroBatch
from trainer.config import DppoLossConfig, TrainerConfig
from trainer.dist import DistContext, close_distributed, full_state_dict, init_distributed, prepare_model
from trainer.logprobs import PolicyModel
from trainer.losses import loss_fns
from trainer.optim import build_optimizer, build_scheduler
from trainer.step import to_batch, train_step

VOCAB = 300
CPU = torch.device("cpu")


def tiny_lm(seed: int = 0, tie: bool = True):
    """A 2-layer random-init Qwen3 in fp32 with SDPA attention."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128, tie_word_embeddings=tie,
                      max_position_embeddings=512)
    cfg._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(cfg).float()
    model.config.use_cache = False
    return model.train()


def micro_batch(step: int, index: int, count: int, lengths: list[tuple[int, int]], mode: str = "rl",
                seed: int = 0, version: int | None = None, temperature: float = 1.0) -> MicroBatch:
    """Samples of (prompt_len, completion_len) packed into one MicroBatch with random tokens and values."""
    rng = np.random.default_rng(seed * 1000 + step * 100 + index)
    ids, pos, mask, adv, inf, teacher, temps = [], [], [], [], [], [], []
    for prompt, completion in lengths:
        n = prompt + completion
        ids.append(rng.integers(0, VOCAB, n))
        pos.append(np.arange(n))
        m = np.r_[np.zeros(prompt, bool), np.ones(completion, bool)]
        mask.append(m)
        adv.append(np.where(m, rng.choice([-1.0, 1.0]), 0.0))
        inf.append(np.where(m, -rng.uniform(4.5, 7.0, n), 0.0))
        teacher.append(np.where(m, -rng.uniform(3.0, 8.0, n), 0.0))
        temps.append(np.full(n, temperature))
    cat = np.concatenate
    return MicroBatch(
        step=step, index=index, count=count, mode=mode, input_ids=cat(ids).astype(np.int32),
        position_ids=cat(pos).astype(np.int32), loss_mask=cat(mask), advantages=cat(adv).astype(np.float32),
        inference_logprobs=cat(inf).astype(np.float32),
        teacher_logprobs=cat(teacher).astype(np.float32) if mode == "opd" else None,
        temperatures=cat(temps).astype(np.float32), sample_lengths=np.array([p + c for p, c in lengths], np.int32),
        policy_versions=np.full(len(lengths), step - 1 if version is None else version, np.int32),
        rewards=rng.uniform(0, 1, len(lengths)).astype(np.float32),
    )


def step_batches(step: int, count: int = 4, seed: int = 0) -> list[MicroBatch]:
    """``count`` micro-batches of step ``step``, mixing rl / sft / opd and sample lengths."""
    modes = ["rl", "sft", "rl", "opd"]
    return [micro_batch(step, i, count, [(3, 5 + i), (2, 4 + 2 * i)], mode=modes[i % 4], seed=seed,
                        temperature=0.7 + 0.1 * i) for i in range(count)]


def fsdp_rank_step(out_path: str, count: int) -> None:
    """Run one train_step on this rank's share of ``step_batches(1, count)`` and save the full weights (rank 0)."""
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    cfg = TrainerConfig(lr=1e-2)
    policy = prepare_model(PolicyModel(tiny_lm(), chunk_size=16), ctx, "cpu", compile_layers=False)
    opt = build_optimizer(policy, cfg)
    sched = build_scheduler(opt, cfg, None)
    mine = [to_batch(mb, CPU, 1) for mb in step_batches(1, count)
            if mb.index % ctx.world_size == ctx.rank]
    metrics = train_step(policy, opt, sched, mine, loss_fns=loss_fns(DppoLossConfig()), ctx=ctx, step=1,
                         max_grad_norm=1.0)
    state = full_state_dict(policy, ctx)
    if ctx.is_main:
        torch.save({"state": {k: v.clone() for k, v in state.items()}, "metrics": metrics}, out_path)
    close_distributed()
    os.environ.pop("RANK", None)


def save_tiny_model(dir: Path, seed: int = 0) -> Path:
    model = tiny_lm(seed)
    model.save_pretrained(dir)
    return dir


def setup_policy(lr=1e-2, seed=0, entropy_grad=False, **cfg):
    policy = PolicyModel(tiny_lm(seed), chunk_size=16, entropy_grad=entropy_grad)
    tcfg = TrainerConfig(lr=lr, **cfg)
    opt = build_optimizer(policy, tcfg)
    return policy, opt, build_scheduler(opt, tcfg, 10)


def step_gradients(mbs, forward_batch=1, entropy_grad=False, **step_kw):
    """Metrics and the (clipped) gradients AdamW is handed in one step. Compare gradients, not updated weights:
    AdamW's first update is ≈ lr·sign(g), so float-rounding noise on a near-zero gradient moves a weight by ~lr."""
    policy, opt, sched = setup_policy(entropy_grad=entropy_grad)
    grads = {}

    def record(_optimizer, _args, _kwargs):
        grads.update({name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None})

    opt.register_step_pre_hook(record)
    return run_step(policy, opt, sched, mbs, forward_batch=forward_batch, **step_kw), grads


def assert_same_gradients(a, b, atol=1e-6):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=atol), name


def run_step(policy, opt, sched, mbs, step=1, forward_batch=1, **step_kw):
    batches = [to_batch(mb, CPU, step) for mb in mbs]
    return train_step(policy, opt, sched, batches, loss_fns=loss_fns(DppoLossConfig()), ctx=DistContext(), step=step,
                      max_grad_norm=1.0, forward_batch=forward_batch, **step_kw)
