"""Packing benchmark: 10k samples of random lengths (64–4096 tokens) into micro-batches.

Prints samples/s of the whole packing path (truncate, first-fit-decreasing plan, building every
MicroBatch's arrays) and of encoding the micro-batches for the wire, beside the bare baseline of
one sample per micro-batch (padded to seq_len). Last line: ``packing efficiency: X``.

    python benchmarks/packer.py [--samples 10000] [--seq-len 8192] [--dp 2]
"""

import argparse
import sys
import time
from pathlib import Path

# Run as a script, this folder comes first on sys.path and benchmarks/bus.py shadows the `bus` package.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import numpy as np  # noqa: E402

from bus.messages import Sample  # noqa: E402
from workers.stages.packing import pack_step, plan  # noqa: E402


def random_samples(n: int, rng: np.random.Generator) -> list[Sample]:
    """Samples of 64–4096 tokens: a prompt of 16–256 tokens, the rest completion."""
    samples = []
    for total in rng.integers(64, 4097, size=n).tolist():
        prompt = int(rng.integers(16, min(256, total - 1) + 1))
        completion = total - prompt
        samples.append(
            Sample(
                prompt_ids=rng.integers(0, 50_000, prompt, dtype=np.int32),
                completion_ids=rng.integers(0, 50_000, completion, dtype=np.int32),
                completion_logprobs=np.full(completion, -1.0, np.float32),
                loss_mask=np.ones(completion, bool),
                reward=float(rng.random()),
                advantage=float(rng.normal()),
            )
        )
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--dp", type=int, default=2, help="data-parallel size (micro-batch count multiple)")
    args = parser.parse_args()
    samples = random_samples(args.samples, np.random.default_rng(0))
    tokens = sum(s.num_tokens for s in samples)

    start = time.perf_counter()
    plan([s.num_tokens for s in samples], [s.mode for s in samples], args.seq_len, args.dp)
    plan_s = time.perf_counter() - start
    start = time.perf_counter()
    batches, stats = pack_step(samples, step=1, seq_len=args.seq_len, dp_size=args.dp)
    pack_s = time.perf_counter() - start
    start = time.perf_counter()
    wire_bytes = sum(len(mb.to_fields()["data"]) for mb in batches)
    encode_s = time.perf_counter() - start

    baseline = tokens / (len(samples) * args.seq_len)
    print(f"samples: {len(samples)}  tokens: {tokens}  seq_len: {args.seq_len}  dp: {args.dp}")
    print(
        f"plan only (first-fit decreasing): {plan_s * 1000:.1f} ms = {len(samples) / plan_s:,.0f} samples/s"
    )
    print(
        f"pack (plan + build arrays): {pack_s:.3f} s = {len(samples) / pack_s:,.0f} samples/s, "
        f"{stats.micro_batches} micro-batches ({stats.padding_micro_batches} padding)"
    )
    print(
        f"encode for the wire: {encode_s:.3f} s = {len(samples) / encode_s:,.0f} samples/s, "
        f"{wire_bytes / 2**20:.1f} MiB"
    )
    print(f"baseline (one sample per micro-batch): {len(samples)} micro-batches, efficiency {baseline:.4f}")
    print(f"packing efficiency: {stats.efficiency:.4f}")


if __name__ == "__main__":
    main()
