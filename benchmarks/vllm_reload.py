"""A weights update into vLLM both ways: vLLM's weight-transfer API against rlbus's worker extension.

Two vLLM servers (``rlbus inference`` with ``inference.backend = "vllm"``) on one model, one with
``inference.vllm_weight_transfer = "native"`` and one with ``"extension"``, each following its own run on one
private Redis. Each round publishes a new safetensors update (the model's weights with noise) to both runs, one
after the other, and waits until each server publishes ``served``. Per update it reports the load itself
(``update_ms`` of the server's ``vllm_reload`` line: start/update/finish, or the ``/collective_rpc``) and the whole
event → served time (pause, load, prefix-cache reset, resume, the follower's own work).

    .venv-vllm/bin/python benchmarks/vllm_reload.py [--updates 20] [--preset tiny]

Needs vLLM (``bash .ci/vllm.sh --build-only`` builds ``.venv-vllm``). Last line:
``extension/native update time ratio: X`` (medians; above 1: the native API is faster).
"""

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

WAYS = ("native", "extension")
SERVER_ID = "vllm-0"


def update_ms(log: Path, step: int) -> float:
    """``update_ms`` of step ``step``'s ``vllm_reload`` line in a server's log."""
    for line in log.read_text().splitlines():
        if "vllm_reload" in line and re.search(rf"\bstep={step}\b", line):
            return float(re.search(r"\bupdate_ms=([\d.]+)", line).group(1))
    raise RuntimeError(f"no vllm_reload line for step {step} in {log}")


async def rounds(redis_url: str, runs: dict[str, str], model, out: Path, updates: int) -> dict[str, list[float]]:
    """Publish ``updates`` updates to every run in turn; each update's event → served seconds per way."""
    import torch

    from bus.config import RedisConfig
    from bus.messages import WeightUpdate
    from bus.policy import PolicyTracker
    from bus.streams import Bus
    from trainer.weights import save_weights, weights_dir

    served: dict[str, list[float]] = {way: [] for way in runs}
    buses = {way: await Bus.connect(redis_url, run, RedisConfig(url=redis_url), "bench") for way, run in runs.items()}
    try:
        for step in range(1, updates + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            for way, bus in buses.items():
                step_dir = weights_dir(out / way, step)
                files = save_weights(model, step_dir)
                tracker = PolicyTracker(bus)
                start = time.perf_counter()
                await bus.publish(bus.keys.weights(),
                                  WeightUpdate(step=step, format="safetensors", dir=str(step_dir), files=files))
                await tracker.wait(lambda t, s=step: t.served_by.get(SERVER_ID, 0) >= s, timeout_s=120)
                served[way].append(time.perf_counter() - start)
    finally:
        for bus in buses.values():
            await bus.close()
    return served


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--updates", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    from bus.local_redis import LocalRedis, free_port
    from tests.workers.inference.process import InferenceProcess
    from workers.tools.init_model import build_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-") as tmp, ExitStack() as stack:
        root = Path(tmp)
        redis = LocalRedis()
        redis_url = redis.start()
        stack.callback(redis.stop)
        model_dir = build_model(root / args.preset, preset=args.preset)
        runs = {way: f"bench-reload-{way}" for way in WAYS}
        for way in WAYS:
            config = root / f"{way}.toml"
            config.write_text(f'[run]\nname = "{runs[way]}"\noutput_dir = "{root / way}"\n[redis]\nurl = '
                              f'"{redis_url}"\nblock_ms = 200\n[model]\npath = "{model_dir}"\n[inference]\n'
                              f'backend = "vllm"\nnum_threads = 1\nmax_model_len = 512\n'
                              f'vllm_weight_transfer = "{way}"\n')
            server = InferenceProcess(config, free_port(), SERVER_ID, log_path=root / f"{way}.log")
            server.start(timeout_s=300)
            stack.callback(server.stop, 60)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        served = asyncio.run(rounds(redis_url, runs, model, root, args.updates))
        loads = {way: [update_ms(root / f"{way}.log", s) for s in range(1, args.updates + 1)] for way in WAYS}
    print(f"model: {args.preset}  updates: {args.updates} per way (alternating)  vLLM on 1 thread, bfloat16")
    for way in WAYS:
        print(f"{way:9s} update (the load) median {statistics.median(loads[way]):6.1f} ms  "
              f"max {max(loads[way]):6.1f} ms   event -> served median "
              f"{statistics.median(served[way]) * 1000:6.1f} ms")
    ratio = statistics.median(loads["extension"]) / statistics.median(loads["native"])
    print(f"extension/native update time ratio: {ratio:.2f}")


if __name__ == "__main__":
    main()
