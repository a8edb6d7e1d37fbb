"""End of an optimizer step → weights served: device-to-host, write, read, load; beside bare safetensors.

    python benchmarks/weights.py                                    # CPU, tiny preset
    python benchmarks/weights.py --device cuda --preset qwen3-0.6b  # 1.11 GiB of bf16 weights

Trainer path: :class:`trainer.weights.HostCopy` (pinned buffers reused across steps on GPU) →
:func:`write_shards` (save_weights' I/O: shards + sha256 + index, temp dir then rename) → :func:`read_weights` →
:func:`load_tensors_into` (in place on the server's device). Bare: ``.cpu()`` (pageable) →
``safetensors.torch.save_file`` → ``load_file(device=...)`` → ``load_state_dict``.
"""

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from presets import PRESETS, build, use_repo_imports

use_repo_imports()

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from trainer.weights import HostCopy, load_tensors_into, read_weights, unique_tensors, write_shards  # noqa: E402


def clock(device, fn):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def trainer_path(model, server, device, root: Path, host: HostCopy, max_shard_mb: int, step: int) -> dict[str, float]:
    state = unique_tensors(model.state_dict())
    cpu, d2h = clock(device, lambda: host(state))
    _, write = clock(device, lambda: write_shards(cpu, root / f"step_{step}", max_shard_mb))  # save_weights' I/O
    tensors, read = clock(device, lambda: read_weights(root / f"step_{step}", "cpu"))
    _, load = clock(device, lambda: load_tensors_into(server, {k: v.to(device, non_blocking=True)
                                                               for k, v in tensors.items()}))
    return dict(d2h=d2h, write=write, read=read, load=load)


def bare_path(model, server, device, root: Path, step: int) -> dict[str, float]:
    state = unique_tensors(model.state_dict())
    cpu, d2h = clock(device, lambda: {k: v.detach().cpu() for k, v in state.items()})
    path = root / f"bare_{step}.safetensors"
    _, write = clock(device, lambda: save_file(cpu, str(path)))
    tensors, read = clock(device, lambda: load_file(str(path), device="cpu"))
    _, load = clock(device, lambda: server.load_state_dict({k: v.to(device) for k, v in tensors.items()}, strict=False))
    return dict(d2h=d2h, write=write, read=read, load=load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS),
                        help="default: small on cpu, qwen3-0.6b on cuda")
    parser.add_argument("--dir", default=None, help="where to write (default: /dev/shm when present, else a temp dir)")
    parser.add_argument("--max-shard-mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    gpu = args.device == "cuda"
    args.preset = args.preset or ("qwen3-0.6b" if gpu else "small")
    if not gpu:
        torch.set_num_threads(1)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if gpu else torch.float32
    model = build(args.preset, device, dtype, seed=0)
    server = build(args.preset, device, dtype, seed=1)
    nbytes = sum(t.numel() * t.element_size() for t in unique_tensors(model.state_dict()).values())
    base = args.dir or ("/dev/shm" if Path("/dev/shm").is_dir() else None)
    root = Path(tempfile.mkdtemp(prefix="rlbus-weights-", dir=base))
    print(f"preset={args.preset} device={device} dtype={dtype} weights={nbytes / 2**30:.3f} GiB dir={root}", flush=True)
    host = HostCopy()
    try:
        rows = {"trainer": [], "bare": []}
        for i in range(args.repeats + 1):  # the first round warms up (pinned buffers, page cache)
            t = trainer_path(model, server, device, root, host, args.max_shard_mb, i)
            b = bare_path(model, server, device, root, i)
            if i:
                rows["trainer"].append(t)
                rows["bare"].append(b)
        totals = {}
        for name, runs in rows.items():
            best = {k: min(r[k] for r in runs) for k in runs[0]}
            totals[name] = total = sum(best.values())
            parts = "  ".join(f"{k} {v:7.3f} s" for k, v in best.items())
            print(f"{name:8s} {parts}  total {total:7.3f} s  ({nbytes / 2**30 / total:.2f} GiB/s)", flush=True)
        for a, b in zip(model.state_dict().values(), server.state_dict().values(), strict=True):
            assert torch.equal(a, b), "server weights differ from the trainer's after loading"
        print(f"trainer/bare time ratio: {totals['trainer'] / totals['bare']:.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
