"""A trainer step with the samples of each group sharing one copy of their prompt vs each holding its own.

    python benchmarks/shared_prompts.py                               # the CPU default's shape: 20 + 5 tokens
    python benchmarks/shared_prompts.py --prompt 74 --completion 9 --seq-len 256   # the spell_backward recipes

``--tasks`` groups of ``--group`` samples, one random prompt per group, packed by the packer's own
``pack_step`` with ``share_prompts`` on and off, then one :func:`trainer.step.train_step` each (dppo loss, entropy
bonus, ``--forward-batch`` micro-batches a pass), taking turns for ``--rounds`` rounds, the order flipped each round.
Prints the tokens each packing trains and the median step times; last line ``unshared/shared step time ratio: X``.
"""

import argparse
import statistics
import time

from presets import PRESETS, build, use_repo_imports

use_repo_imports()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bus.messages import Sample  # noqa: E402
from trainer.config import DppoLossConfig, TrainerConfig  # noqa: E402
from trainer.dist import DistContext  # noqa: E402
from trainer.logprobs import PolicyModel  # noqa: E402
from trainer.losses import loss_fns  # noqa: E402
from trainer.optim import build_optimizer, build_scheduler  # noqa: E402
from trainer.step import to_batch, train_step  # noqa: E402
from workers.stages.packing import pack_step  # noqa: E402

CPU = torch.device("cpu")


def groups(args, vocab: int) -> list[Sample]:
    rng = np.random.default_rng(0)
    samples = []
    for task in range(args.tasks):
        prompt = rng.integers(0, vocab, args.prompt).astype(np.int32)
        for i in range(args.group):
            samples.append(Sample(
                prompt_ids=prompt, completion_ids=rng.integers(0, vocab, args.completion).astype(np.int32),
                completion_logprobs=-rng.uniform(1, 3, args.completion).astype(np.float32),
                loss_mask=np.ones(args.completion, dtype=bool), advantage=float(rng.normal()),
                task_id=f"bench:0:{task}", index=i))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", type=int, default=20, help="prompt tokens")
    parser.add_argument("--completion", type=int, default=5, help="completion tokens")
    parser.add_argument("--group", type=int, default=8, help="samples a group")
    parser.add_argument("--tasks", type=int, default=16, help="groups a step")
    parser.add_argument("--seq-len", type=int, default=128, help="packer.seq_len")
    parser.add_argument("--forward-batch", type=int, default=8, help="trainer.forward_batch")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build(args.preset, CPU, torch.float32)
    policy = PolicyModel(model, entropy_grad=True, keep_bytes=2**30)
    cfg = TrainerConfig(lr=1e-6)
    optimizer = build_optimizer(policy, cfg)
    scheduler = build_scheduler(optimizer, cfg, None)
    samples = groups(args, PRESETS[args.preset]["vocab_size"])
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds + 1):  # round 0 warms up
        for share in (True, False) if r % 2 else (False, True):
            micro_batches, stats = pack_step(samples, step=1, seq_len=args.seq_len, dp_size=1, share_prompts=share)
            start = time.perf_counter()
            batches = [to_batch(mb, CPU, 1) for mb in micro_batches]
            train_step(policy, optimizer, scheduler, batches, loss_fns=loss_fns(DppoLossConfig()), ctx=DistContext(),
                       step=1, max_grad_norm=1.0, forward_batch=args.forward_batch, entropy_coef=0.01)
            if r:
                times[share].append(time.perf_counter() - start)
            else:
                print(f"{'shared' if share else 'unshared':<8} {stats.tokens:6d} tokens in {len(micro_batches)} "
                      f"micro-batches of {args.seq_len}")
    shared, unshared = statistics.median(times[True]), statistics.median(times[False])
    print(f"step time (median of {args.rounds}): shared {shared * 1e3:.0f} ms, unshared {unshared * 1e3:.0f} ms")
    print(f"unshared/shared step time ratio: {unshared / shared:.2f}")


if __name__ == "__main__":
    main()
