"""Generated tokens/s of ``rlbus inference`` under N concurrent requests vs bare ``model.generate``.

Both sides generate ``--max-tokens`` sampled tokens (EOS ignored) for the same ``--requests`` prompts,
in the same run and with the same thread count, in alternating rounds; each side's best of ``--repeats``
is reported. The
server number includes HTTP and JSON. On a shared CPU the numbers are noisy: compare the ratio.

    python benchmarks/inference.py [--model DIR | --preset tiny] [--requests 32] [--max-tokens 64]
    python benchmarks/inference.py --backend vllm   # in a venv with vLLM (.venv-vllm, see .ci/vllm.sh)

Last line: ``server/bare ratio: X``. With ``--backend vllm`` the built-in server and vLLM (``rlbus inference``
with ``inference.backend = "vllm"``, bfloat16, eager) both run, one after the other within each round under the
same prompts, tokens and threads; both are printed, and the last line is ``vllm/built-in ratio: X``.
"""

import argparse
import asyncio
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

# benchmarks/bus.py would shadow the ``bus`` package when this file runs as a script; the repository root goes
# first instead (the checkout's packages, and tests/ for the InferenceProcess helper).
sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]


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


async def measure(base_urls: dict[str, str], bare: BareGenerate, prompts: list[str], max_tokens: int,
                  repeats: int) -> dict[str, float]:
    """Alternate rounds of every server and the bare model (after one warm-up of each) so all see the same machine
    load; each one's best round."""
    from workers.inference.client import InferenceClient

    best = dict.fromkeys([*base_urls, "bare"], 0.0)
    clients = {name: InferenceClient([url]) for name, url in base_urls.items()}
    try:
        for round in range(repeats + 1):
            got = {name: await server_tokens_per_s(client, prompts, max_tokens) for name, client in clients.items()}
            got["bare"] = bare.tokens_per_s(max_tokens)
            if round:
                best = {name: max(best[name], got[name]) for name in best}
    finally:
        for client in clients.values():
            await client.close()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model folder (default: build the preset in a temp dir)")
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on each side")
    parser.add_argument("--backend", default="transformers", choices=["transformers", "vllm"],
                        help="vllm: measure vLLM too, beside the built-in server, in the same rounds")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from bus.local_redis import free_port
    from tests.workers.inference.process import InferenceProcess
    from workers.tools.init_model import build_model

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-") as tmp, ExitStack() as servers:
        model_dir = args.model or build_model(Path(tmp) / args.preset, preset=args.preset)
        backends = ["transformers"] + (["vllm"] if args.backend == "vllm" else [])
        urls = {}
        for backend in backends:
            config = Path(tmp) / f"bench-{backend}.toml"
            config.write_text(f'[run]\noutput_dir = "{Path(tmp) / backend}"\n[model]\npath = "{model_dir}"\n'
                              f'[inference]\nbackend = "{backend}"\nnum_threads = {args.threads}\n'
                              f"max_batch_size = {max(64, args.requests)}\n")
            srv = InferenceProcess(config, free_port(), threads=args.threads, log_path=Path(tmp) / f"{backend}.log")
            srv.start(timeout_s=300 if backend == "vllm" else 120)
            servers.callback(srv.stop, 60)
            urls[backend] = srv.base_url
        prompts = [f"Prompt number {i}: say something." for i in range(args.requests)]
        bare_model = BareGenerate(model_dir, prompts)
        best = asyncio.run(measure(urls, bare_model, prompts, args.max_tokens, args.repeats))
    print(f"model: {args.model or args.preset}  requests: {args.requests}  max_tokens: {args.max_tokens}  "
          f"threads: {args.threads}  (best of {args.repeats})")
    print(f"server (HTTP, {args.requests} concurrent requests): {best['transformers']:,.0f} generated tok/s")
    if "vllm" in best:
        print(f"vllm server (HTTP, {args.requests} concurrent requests, bfloat16, eager): {best['vllm']:,.0f} "
              "generated tok/s")
    print(f"bare model.generate ({args.requests} prompts, one batch): {best['bare']:,.0f} generated tok/s")
    print(f"server/bare ratio: {best['transformers'] / best['bare']:.2f}")
    if "vllm" in best:
        print(f"vllm/bare ratio: {best['vllm'] / best['bare']:.2f}")
        print(f"vllm/built-in ratio: {best['vllm'] / best['transformers']:.2f}")


if __name__ == "__main__":
    main()
