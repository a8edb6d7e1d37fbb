"""The trainer and the inference engine on CUDA: logprobs, one train step, weights round trip, generation.

Every test is marked ``gpu`` and skipped when no CUDA device is visible (CI):
``python3 -m pytest tests/trainer/test_gpu.py -q -m gpu`` on a GPU machine (benchmarks/gpu_check.sh runs it).
The model is a random-init 4-layer Qwen3 (hidden 256, vocab 4096) with ``initializer_range=0.1`` so its
next-token distributions are peaked (logit std ≈ 1.6) rather than near-uniform, which would hide errors.
"""

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.trainer.helpers import micro_batch, step_batches
from trainer.config import DppoLossConfig, TrainerConfig
from trainer.dist import DistContext
from trainer.logprobs import PolicyModel
from trainer.losses import loss_fns
from trainer.optim import build_optimizer, build_scheduler
from trainer.step import to_batch, train_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() False)"),
]

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
VOCAB = 4096
TEMPERATURE = 0.8
# bf16 vs fp32 logprobs: bf16 keeps 8 significant bits (relative rounding 2^-9), weights are rounded once,
# activations after each of the 4 layers, and the head's logits (|z/τ| up to ~20) are rounded before the fp32
# softmax (up to ~0.04 each). Measured on CPU for this model and these tokens: max 0.16, mean 0.037.
BF16_MAX_ABS = 0.5
BF16_MEAN_ABS = 0.1


def qwen3(seed: int = 0):
    """A random-init 4-layer Qwen3 in fp32 on CPU, SDPA attention, tied head, train mode."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                      max_position_embeddings=1024, initializer_range=0.1, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).float().train()


def packed(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, position_ids, temperatures) of random samples packed into one sequence, on CPU."""
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(rng.integers(0, VOCAB, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])
    return ids, pos, torch.full((sum(lengths),), TEMPERATURE)


def logprobs_on(lm, device: torch.device, dtype: torch.dtype, ids, pos, temps, chunk_size: int = 64):
    """Chunked (logprobs, entropy) of a copy of ``lm`` in ``dtype`` on ``device``, back on CPU."""
    policy = PolicyModel(copy.deepcopy(lm).to(device=device, dtype=dtype), chunk_size=chunk_size)
    with torch.no_grad():
        out = policy(ids.to(device), pos.to(device), temps.to(device))
    return out.logprobs.cpu(), out.entropy.cpu()


def test_cuda_logprobs_match_cpu_fp32_and_bf16_within_rounding():
    lm = qwen3()
    ids, pos, temps = packed([60, 97, 140])  # 297 tokens: several 64-token chunks, boundaries inside chunks
    ref_lp, ref_ent = logprobs_on(lm, CPU, torch.float32, ids, pos, temps)
    assert ref_ent[1:].mean() < 0.9 * np.log(VOCAB)  # peaked, not uniform: errors would show
    lp, ent = logprobs_on(lm, CUDA, torch.float32, ids, pos, temps)
    assert (lp - ref_lp).abs().max() < 1e-4
    assert (ent - ref_ent).abs().max() < 1e-4
    lp16, ent16 = logprobs_on(lm, CUDA, torch.bfloat16, ids, pos, temps)
    diff = (lp16 - ref_lp).abs()
    assert diff.max() < BF16_MAX_ABS and diff.mean() < BF16_MEAN_ABS, (diff.max(), diff.mean())
    assert (ent16 - ref_ent).abs().mean() < BF16_MEAN_ABS


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, BF16_MAX_ABS)])
def test_cuda_packed_logprobs_equal_unpacked(dtype, atol):
    """Samples packed in one sequence never attend across boundaries (block-diagonal mask from position ids)."""
    lengths = [33, 80, 5, 120]
    ids, pos, temps = packed(lengths, seed=1)
    policy = PolicyModel(qwen3().to(device=CUDA, dtype=dtype), chunk_size=50)
    ids, pos, temps = ids.to(CUDA), pos.to(CUDA), temps.to(CUDA)
    with torch.no_grad():
        whole = policy(ids, pos, temps).logprobs
        pieces = [policy(i, p, t).logprobs
                  for i, p, t in zip(ids.split(lengths), pos.split(lengths), temps.split(lengths), strict=True)]
    diff = (whole - torch.cat(pieces)).abs()  # bf16: packed and single samples may take different SDPA kernels
    assert diff.max() < atol, diff.max()
    assert diff.mean() < min(atol, BF16_MEAN_ABS), diff.mean()
    # Cross-sample leakage would change a sample's logprobs by far more than rounding: check it is detectable.
    leaked = PolicyModel(policy.lm, chunk_size=50)(ids, torch.arange(len(ids), device=CUDA), temps).logprobs
    assert (leaked - whole)[lengths[0] + 1:].abs().max() > 1.0


def test_cuda_chunked_logprob_grads_match_full_logits():
    lm = qwen3().to(CUDA)
    ids, pos, temps = (t.to(CUDA) for t in packed([150]))
    weights = torch.randn(len(ids), device=CUDA)
    out = PolicyModel(lm, chunk_size=64)(ids, pos, temps)
    (out.logprobs * weights).sum().backward()
    chunked = [p.grad.clone() for p in lm.parameters()]
    lm.zero_grad()
    logp = torch.log_softmax(lm(input_ids=ids[None]).logits[0, :-1].float() / TEMPERATURE, -1)
    ref = logp.gather(-1, ids[1:, None])[:, 0]
    (ref * weights[1:]).sum().backward()
    assert torch.allclose(out.logprobs[1:], ref, atol=1e-4)
    for got, want in zip(chunked, [p.grad for p in lm.parameters()], strict=True):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-3)


def test_cuda_shared_prompts_give_the_gradients_of_unshared_packing():
    """The shared-prompt attention mask and sources on CUDA (fp32): one step's gradients as if unshared."""
    from tests.trainer.test_shared_prompts import groups
    from workers.stages.packing import pack_step

    grads = {}
    for share in (True, False):
        policy = PolicyModel(qwen3().to(CUDA), chunk_size=64)
        cfg = TrainerConfig(lr=1e-3)
        opt = build_optimizer(policy, cfg)
        opt.register_step_pre_hook(lambda *_, share=share, policy=policy: grads.__setitem__(
            share, [p.grad.clone() for p in policy.parameters() if p.grad is not None]))
        micro_batches = pack_step(groups(), step=1, seq_len=16, dp_size=1, share_prompts=share)[0]
        assert any(mb.shares_prompts for mb in micro_batches) == share
        train_step(policy, opt, build_scheduler(opt, cfg, 10), [to_batch(mb, CUDA, 1) for mb in micro_batches],
                   loss_fns=loss_fns(DppoLossConfig()), ctx=DistContext(), step=1, max_grad_norm=None,
                   forward_batch=3)
    for got, want in zip(grads[True], grads[False], strict=True):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-3)


def test_cuda_train_step_in_bf16_lowers_the_loss_and_reports_mfu(tmp_path):
    from trainer.model import count_parameters, load_model, resolve_device, resolve_dtype

    qwen3().save_pretrained(tmp_path / "model")
    device = resolve_device("auto")
    dtype = resolve_dtype("auto", device)
    assert device.type == "cuda" and dtype == torch.bfloat16
    lm = load_model(tmp_path / "model", device, dtype)  # what the trainer worker does on a GPU
    assert next(lm.parameters()).dtype == torch.bfloat16
    policy = PolicyModel(lm, chunk_size=128)
    cfg = TrainerConfig(lr=1e-3)
    opt = build_optimizer(policy, cfg)
    sched = build_scheduler(opt, cfg, 10)
    fns = loss_fns(DppoLossConfig())
    n_params = count_parameters(lm)

    def step(mbs, s):
        batches = [to_batch(mb, device, s) for mb in mbs]
        return train_step(policy, opt, sched, batches, loss_fns=fns, ctx=DistContext(), step=s, max_grad_norm=1.0,
                          n_params=n_params)

    mixed = step(step_batches(1, count=4), 1)  # rl, sft, rl, opd
    for key, value in mixed.items():
        assert np.isfinite(value), (key, value)
    for key in ("loss/rl", "loss/sft", "loss/opd", "grad_norm", "entropy", "mismatch_kl", "tokens_per_s",
                "peak_memory_gib"):
        assert key in mixed, key
    from trainer.step import peak_flops

    if peak_flops(device):
        assert 0 < mixed["mfu"] < 1, mixed["mfu"]
    sft = [micro_batch(2, 0, 1, [(8, 120), (5, 90)], mode="sft")]
    first = step(sft, 2)
    second = step([mb.replace(step=3) for mb in sft], 3)
    assert second["loss/sft"] < first["loss/sft"] - 1e-2, (first["loss/sft"], second["loss/sft"])


def test_cuda_weights_round_trip_through_pinned_host_buffers(tmp_path):
    from bus.weight_files import verify_weights
    from trainer.weights import HostCopy, load_weights_into, save_weights, unique_tensors

    src = qwen3(seed=1).to(device=CUDA, dtype=torch.bfloat16)
    dst = qwen3(seed=2).to(device=CUDA, dtype=torch.bfloat16)
    host = HostCopy()
    copies = host(unique_tensors(src.state_dict()))
    assert all(t.device.type == "cpu" and t.is_pinned() for t in copies.values())
    ids = torch.randint(0, VOCAB, (2, 40), device=CUDA)
    for step in (1, 2):  # the second save reuses the pinned buffers after the weights changed
        files = save_weights(src, tmp_path / f"step_{step}", max_shard_mb=1, host_copy=host)
        assert len(files) > 1
        verify_weights(tmp_path / f"step_{step}", files)
        load_weights_into(dst, tmp_path / f"step_{step}")
        with torch.no_grad():
            assert torch.equal(src(input_ids=ids).logits, dst(input_ids=ids).logits)
        assert dst.lm_head.weight is dst.model.embed_tokens.weight
        with torch.no_grad():
            for p in src.parameters():
                p.add_(torch.randn_like(p) * 0.01)


@pytest.fixture
def engine():
    from workers.inference.engine import Engine

    model = qwen3(seed=3).to(CUDA).eval()
    tokenizer = SimpleNamespace(pad_token_id=0, decode=lambda ids, skip_special_tokens=True: "")
    eng = Engine(model, tokenizer, max_batch_size=8, max_model_len=256, eos_token_ids={VOCAB - 1})
    eng.start()
    yield eng
    eng.stop()


def test_cuda_engine_logprobs_match_a_forward_pass_and_greedy_is_argmax(engine):
    from workers.inference.sampling import SamplingParams

    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, VOCAB, 3 + 9 * i).tolist() for i in range(10)]  # 10 requests, batch 8: some join late
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=20 + 4 * i, ignore_eos=True,
                             seed=i if i % 2 else None) for i in range(10)]
    params[3] = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    params[7] = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    handles = [engine.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
    for handle in handles:
        gen = handle.future.result(timeout=120)
        out = gen.choices[0].token_ids
        assert len(out) == handle.params.max_tokens
        greedy = handle.params.temperature == 0
        ids = torch.tensor([gen.prompt_token_ids + out], device=CUDA)
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0].float()
        n = len(gen.prompt_token_ids)
        lp = torch.log_softmax(logits / (1.0 if greedy else TEMPERATURE), -1)[n - 1 : -1]
        expected = lp.gather(1, torch.tensor(out, device=CUDA)[:, None])[:, 0]
        got = torch.tensor(gen.choices[0].logprobs, device=CUDA)
        assert (got - expected).abs().max() < 1e-3, (got - expected).abs().max()
        if greedy:
            top2 = logits[n - 1 : -1].topk(2, dim=-1)
            for t, token in enumerate(out):
                if token != int(top2.indices[t, 0]):  # only a near-tie may flip under GPU rounding
                    assert float(top2.values[t, 0] - top2.values[t, 1]) < 1e-3, (t, token)
    assert engine.active == 0 and engine.error is None


def test_cuda_engine_greedy_equals_step_by_step_argmax_decoding(engine):
    from workers.inference.sampling import SamplingParams

    prompt = np.random.default_rng(3).integers(1, VOCAB, 17).tolist()
    gen = engine.submit(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)).future.result(60)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(24):
            logits = engine.model(input_ids=torch.tensor([ids], device=CUDA)).logits[0, -1].float()
            top2 = logits.topk(2)
            nxt = int(top2.indices[0])
            got = gen.choices[0].token_ids[len(ids) - len(prompt)]
            if got != nxt:
                assert float(top2.values[0] - top2.values[1]) < 1e-3, (len(ids) - len(prompt), got, nxt)
                return
            ids.append(nxt)
    assert gen.choices[0].token_ids == ids[len(prompt):]
