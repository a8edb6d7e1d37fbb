"""Trainer step vs a bare PyTorch loop: tokens/s and peak memory, same model and tokens, same run.

    python benchmarks/trainer.py                                   # CPU, tiny preset
    python benchmarks/trainer.py --device cuda --preset qwen3-0.6b [--compile]   # 8 × 2048 tokens, bf16

Bare loop: ``model(input_ids[B, L]).logits.float()`` → log_softmax → gather → policy-gradient loss
→ backward → AdamW (full-vocab fp32 logits). Trainer: :func:`trainer.step.train_step` on the same
tokens as B micro-batches of L tokens (chunked logprobs, dppo loss, clipping, metrics).

Both loops live in one process and take turns: ``--rounds`` rounds of ``--steps`` steps each, the order flipped
every round, so a busy machine slows both alike. Each round gives a ratio; the last line is their median,
``trainer/bare ratio: X`` (tokens/s), after the spread of the rounds. Peak memory is the process's (both
models are in it): compare memory with ``--only``.
"""

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

from presets import PRESETS, build, use_repo_imports

use_repo_imports()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from trainer.dist import DistContext  # noqa: E402
from trainer.logprobs import PolicyModel  # noqa: E402
from trainer.losses import dppo_loss  # noqa: E402
from trainer.model import count_parameters  # noqa: E402
from trainer.optim import build_optimizer, build_scheduler  # noqa: E402
from trainer.step import Batch, peak_flops, train_flops, train_step  # noqa: E402

# Only torch/transformers/safetensors are needed (no pydantic/msgpack): the GPU box has nothing else.
TRAINER_CFG = SimpleNamespace(lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=0, schedule="constant",
                              min_lr_ratio=0.0)


def data(args, vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq_len)
    return dict(ids=rng.integers(0, vocab, shape), adv=rng.choice([-1.0, 1.0], shape).astype(np.float32),
                inf=-rng.uniform(8, 13, shape).astype(np.float32))


def micro_batches(d: dict[str, np.ndarray], args) -> list[dict[str, np.ndarray]]:
    """Each sequence as one micro-batch of ``seq_len // sample_len`` packed samples (host arrays, like a MicroBatch)."""
    lengths = np.full(args.seq_len // args.sample_len, args.sample_len, np.int64)
    pos = np.concatenate([np.arange(n) for n in lengths])
    return [dict(input_ids=d["ids"][i], position_ids=pos, loss_mask=pos > 0, advantages=d["adv"][i],
                 inference_logprobs=d["inf"][i], temperatures=np.ones(args.seq_len, np.float32), lengths=lengths)
            for i in range(args.batch)]


def to_device(mb: dict[str, np.ndarray], device) -> Batch:
    """What trainer.step.to_batch does with a MicroBatch: host arrays → device tensors."""
    t = {k: torch.from_numpy(v).to(device, non_blocking=True) for k, v in mb.items() if k != "lengths"}
    return Batch(mode="rl", input_ids=t["input_ids"], position_ids=t["position_ids"], temperatures=t["temperatures"],
                 loss_mask=t["loss_mask"], advantages=t["advantages"], inference_logprobs=t["inference_logprobs"],
                 teacher_logprobs=None, on_policy=t["loss_mask"], sample_lengths=mb["lengths"],
                 rewards=np.zeros(len(mb["lengths"])), steps_off_policy=0.0)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:
            open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM (peak RSS)
        except OSError:
            pass


def peak_gib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def compile_layers(model):
    for layer in model.model.layers:
        layer.compile()


def bare_step(args, device, dtype, d) -> Callable[[], None]:
    model = build(args.preset, device, dtype)
    if args.compile:
        compile_layers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.from_numpy(d["ids"]).to(device)
    adv = torch.from_numpy(d["adv"]).to(device)[:, 1:]
    inf = torch.from_numpy(d["inf"]).to(device)[:, 1:]

    def step():
        logits = model(input_ids=ids).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(adv * (logp - inf).exp()).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def trainer_step(args, device, dtype, d) -> Callable[[], None]:
    lm = build(args.preset, device, dtype)
    policy = PolicyModel(lm, chunk_size=args.chunk_size, compile_head=args.compile,
                         keep_bytes=args.logits_keep_mb * 2**20)
    if args.compile:
        compile_layers(lm)
    opt = build_optimizer(policy, TRAINER_CFG)
    sched = build_scheduler(opt, TRAINER_CFG, None)
    mbs = micro_batches(d, args)
    fns = {"rl": dppo_loss}
    n_params = count_parameters(lm)

    def step():
        batches = [to_device(mb, device) for mb in mbs]
        train_step(policy, opt, sched, batches, loss_fns=fns, ctx=DistContext(), step=1, max_grad_norm=1.0,
                   n_params=n_params, forward_batch=args.forward_batch)

    return step


def warm_up(step, args, device) -> float:
    """Run the warmup steps; returns the first one's seconds (compilation, allocation)."""
    t0 = time.perf_counter()
    step()
    sync(device)
    first = time.perf_counter() - t0
    for _ in range(args.warmup - 1):
        step()
    sync(device)
    return first


def timed(step, args, device) -> tuple[float, float]:
    """(tokens/s, peak GiB) over args.steps steps."""
    reset_peak(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(device)
    elapsed = time.perf_counter() - t0
    return args.batch * args.seq_len * args.steps / elapsed, peak_gib(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS),
                        help="default: tiny on cpu, qwen3-0.6b on cuda")
    parser.add_argument("--batch", type=int, default=None, help="sequences (micro-batches); default 4 cpu / 8 cuda")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence; default 256 cpu / 2048 cuda")
    parser.add_argument("--sample-len", type=int, default=None, help="tokens per packed sample (default: seq-len)")
    parser.add_argument("--chunk-size", type=int, default=1024, help="logprob chunk (tokens)")
    parser.add_argument("--logits-keep-mb", type=int, default=1024,
                        help="trainer.logits_keep_mb: MiB the head may keep for its backward (0: recompute)")
    parser.add_argument("--forward-batch", type=int, default=None,
                        help="trainer micro-batches per forward pass (trainer.forward_batch); "
                             "default: --batch, as bare")
    parser.add_argument("--steps", type=int, default=None, help="steps per round; default 10 cpu / 3 cuda")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds each loop runs, taking turns; default 7 cpu / 3 cuda")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (both loops)")
    parser.add_argument("--only", choices=["trainer", "bare"], default=None)
    args = parser.parse_args()
    gpu = args.device == "cuda"
    args.preset = args.preset or ("qwen3-0.6b" if gpu else "tiny")
    args.batch = args.batch or (8 if gpu else 4)
    args.seq_len = args.seq_len or (2048 if gpu else 256)
    args.sample_len = args.sample_len or args.seq_len
    args.forward_batch = args.forward_batch or args.batch
    args.steps = args.steps or (3 if gpu else 10)
    args.rounds = args.rounds or (3 if gpu else 7)
    args.warmup = max(1, args.warmup)
    torch.set_num_threads(torch.get_num_threads() if gpu else 1)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if gpu else torch.float32
    d = data(args, PRESETS[args.preset]["vocab_size"])
    print(f"preset={args.preset} device={device} dtype={dtype} tokens/step={args.batch}x{args.seq_len} "
          f"sample_len={args.sample_len} compile={args.compile} steps={args.steps} rounds={args.rounds} "
          f"warmup={args.warmup} forward_batch={args.forward_batch}", flush=True)
    flops = peak_flops(device)
    meta = PolicyModel(build(args.preset, "meta", dtype)) if flops else None
    names = [name for name in ("trainer", "bare") if not args.only or args.only == name]
    builders = {"trainer": trainer_step, "bare": bare_step}
    steps = {name: builders[name](args, device, dtype, d) for name in names}
    first = {name: warm_up(steps[name], args, device) for name in names}
    rounds: dict[str, list[float]] = {name: [] for name in names}
    peaks: dict[str, float] = dict.fromkeys(names, 0.0)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            tps, peak = timed(steps[name], args, device)
            rounds[name].append(tps)
            peaks[name] = max(peaks[name], peak)
    for name in names:
        tps = statistics.median(rounds[name])
        line = f"{name:8s} {tps:10.0f} tokens/s  peak {peaks[name]:6.2f} GiB  first step {first[name]:6.1f} s"
        if flops:  # one second's tokens, in samples of sample_len: Σ len² = tokens · sample_len
            line += f"  MFU {train_flops(meta, count_parameters(meta.lm), tps, tps * args.sample_len) / flops:5.1%}"
        print(line, flush=True)
    if len(names) == 2:
        ratios = [t / b for t, b in zip(rounds["trainer"], rounds["bare"], strict=True)]
        print(f"rounds: {' '.join(f'{x:.3f}' for x in ratios)} (min {min(ratios):.3f}, max {max(ratios):.3f})")
        print(f"trainer/bare ratio: {statistics.median(ratios):.3f}")

if __name__ == "__main__":
    main()
