"""Generated tokens/s of ``rlbus inference`` under N concurrent requests vs bare ``model.generate``.

Both sides generate ``--max-tokens`` sampled tokens (EOS ignored) for the same ``--requests`` prompts,
in the same run and with the same thread count, in alternating rounds; each side's best of ``--repeats``
is reported. The
server number includes HTTP and JSON. On a shared CPU the numbers are noisy: compare the ratio.

    python benchmarks/inference.py [--model DIR | --preset tiny] [--requests 32] [--max-tokens 64]

Last line: ``server/bare ratio: X``.
"""

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/bus.py would shadow the ``bus`` package when this file runs as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


class BareGenerate:
    """``model.generate`` of all prompts in one left-padded batch, in this process."""

    def __init__(self, model_dir: Path, prompts: list[str]):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)

    def tokens_per_s(self, max_tokens: int) -> float:
        import torch

        start = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(**self.batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                      do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        seconds = time.perf_counter() - start
        return (out.shape[1] - self.batch["input_ids"].shape[1]) * out.shape[0] / seconds


async def server_tokens_per_s(client, prompts: list[str], max_tokens: int) -> float:
    ids = [list(p.encode()) for p in prompts]  # the byte-level tokenizer: token id = byte
    start = time.perf_counter()
    results = await asyncio.gather(*(client.completions(p, max_tokens=max_tokens, temperature=1.0,
                                                        extra_body={"ignore_eos": True}) for p in ids))
    seconds = time.perf_counter() - start
    return sum(len(r.choices[0].token_ids) for r in results) / seconds


async def measure(base_url: str, bare: BareGenerate, prompts: list[str], max_tokens: int,
                  repeats: int) -> tuple[float, float]:
    """Alternate server and bare rounds (after one warm-up of each) so both see the same machine load."""
    from workers.inference.client import InferenceClient

    server_best = bare_best = 0.0
    async with InferenceClient([base_url]) as client:
        for round in range(repeats + 1):
            server = await server_tokens_per_s(client, prompts, max_tokens)
            plain = bare.tokens_per_s(max_tokens)
            if round:
                server_best, bare_best = max(server_best, server), max(bare_best, plain)
    return server_best, bare_best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model folder (default: build the preset in a temp dir)")
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on each side")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from bus.local_redis import free_port
    from workers.inference.process import InferenceProcess
    from workers.tools.init_model import build_model

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-") as tmp:
        model_dir = args.model or build_model(Path(tmp) / args.preset, preset=args.preset)
        config = Path(tmp) / "bench.toml"
        config.write_text(f'[model]\npath = "{model_dir}"\n[inference]\nnum_threads = {args.threads}\n'
                          f"max_batch_size = {max(64, args.requests)}\n")
        prompts = [f"Prompt number {i}: say something." for i in range(args.requests)]
        bare_model = BareGenerate(model_dir, prompts)
        with InferenceProcess(config, free_port(), threads=args.threads, log_path=Path(tmp) / "server.log") as srv:
            server, bare = asyncio.run(measure(srv.base_url, bare_model, prompts, args.max_tokens, args.repeats))
    print(f"model: {args.model or args.preset}  requests: {args.requests}  max_tokens: {args.max_tokens}  "
          f"threads: {args.threads}  (best of {args.repeats})")
    print(f"server (HTTP, {args.requests} concurrent requests): {server:,.0f} generated tok/s")
    print(f"bare model.generate ({args.requests} prompts, one batch): {bare:,.0f} generated tok/s")
    print(f"server/bare ratio: {server / bare:.2f}")


if __name__ == "__main__":
    main()
