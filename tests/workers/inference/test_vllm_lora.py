"""LoRA on vLLM: each version's adapter event is loaded at runtime (``/v1/load_lora_adapter``) under its own name;
a request naming it gets the merged model's completion, the base model stays servable, old versions are unloaded.

Runs in the vLLM venv (``bash .ci/vllm.sh``); vLLM starts once for the module (~40 s on CPU)."""


import pytest
import torch

try:
    import vllm  # noqa: F401
except Exception as e:  # ImportError, or a broken CUDA build of a vLLM dependency
    pytest.skip(f"vllm is not importable ({type(e).__name__}: {e}); run with the vLLM venv (bash .ci/vllm.sh)",
                allow_module_level=True)

from bus.messages import WeightUpdate
from bus.policy import PolicyTracker
from tests.workers.inference.vllm_server import run_name, vllm_server
from trainer.lora import adapter_tensors, inject, merged_model, peft_config, save_adapter
from trainer.model import load_model
from trainer.weights import weights_dir
from workers.inference.client import InferenceClient

# The module fixture starts vLLM (~40 s on CPU) within the first test's time budget, which pytest-timeout
# counts with the fixture: the default 60 s left a cold first request 20 s (CI once took 19 s and failed).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(180)]

SERVER_ID = "vllm-lora-0"
PROMPT = [257, 72, 101, 108, 108, 111, 10, 258, 10, 50, 60, 70]
LOGPROB_TOL = 0.1
"""bf16 (vLLM) vs fp32 (transformers), as in test_vllm.py."""
TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def run() -> str:
    return run_name("t-vllm-lora")


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-lora")


@pytest.fixture(scope="module")
def server(tiny_model_dir, redis_server, run, out_dir):
    with vllm_server(out_dir, SERVER_ID,
                     f'[run]\nname = "{run}"\noutput_dir = "{out_dir}"\n[redis]\nurl = "{redis_server}"\n'
                     f'block_ms = 200\n[model]\npath = "{tiny_model_dir}"\n[model.lora]\nrank = 4\nalpha = 8\n'
                     f'target_modules = {TARGETS}\n[packer]\nmax_off_policy_steps = 1\n') as proc:
        yield proc


def adapter_step(model_dir, out_dir, step: int):
    """Write the adapter of version ``step`` (random B) where the trainer would; returns its WeightUpdate."""
    torch.manual_seed(step)
    lm = load_model(model_dir, torch.device("cpu"), torch.float32)
    config = peft_config(4, 8, 0.0, TARGETS, str(model_dir))
    inject(lm, config)
    with torch.no_grad():
        for name, param in lm.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.3)
    path = weights_dir(out_dir, step)
    files = save_adapter(adapter_tensors(lm.state_dict()), path, config)
    return WeightUpdate(step=step, format="safetensors", dir=str(path), files=files, adapter=f"r4-a8-step{step}")


async def greedy(server, model: str | None):
    async with InferenceClient([server.base_url], timeout_s=60, max_retries=0, model=model) as client:
        return await client.completions(PROMPT, temperature=0.0, max_tokens=10, extra_body={"ignore_eos": True})


def reference(model) -> tuple[list[int], list[float]]:
    ids, logprobs = list(PROMPT), []
    with torch.no_grad():
        for _ in range(10):
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            ids.append(int(lp.argmax()))
            logprobs.append(float(lp.max()))
    return ids[len(PROMPT):], logprobs


async def test_each_version_is_served_under_its_adapter_name(server, tiny_model_dir, out_dir, bus, run):
    from transformers import AutoModelForCausalLM

    base_tokens, _ = reference(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval())
    events = [adapter_step(tiny_model_dir, out_dir, step) for step in (1, 2, 3, 4, 5)]

    async def publish(event):
        async with bus("trainer-probe", run=run) as b:
            await b.publish(b.keys.weights(), event)
            await PolicyTracker(b).wait(lambda t: t.served_by.get(SERVER_ID) == event.step, timeout_s=60)

    await publish(events[0])
    first = await greedy(server, "r4-a8-step1")
    tokens, logprobs = reference(merged_model(tiny_model_dir, events[0].dir).eval())
    assert tokens != base_tokens  # the adapter changes the policy
    assert first.choices[0].token_ids[:4] == tokens[:4]  # bf16 vs fp32: the first tokens agree
    gaps = [abs(a - b) for a, b in zip(first.choices[0].logprobs[:4], logprobs[:4], strict=True)]
    assert max(gaps) < LOGPROB_TOL, gaps
    assert (await greedy(server, None)).choices[0].token_ids[:4] == base_tokens[:4]  # the base model is still served

    for event in events[1:]:  # max_loras = max_off_policy_steps + prefetch + 2 = 4: version 5 unloads version 1
        await publish(event)
    assert (await greedy(server, "r4-a8-step5")).choices
    assert (await greedy(server, "r4-a8-step2")).choices  # still loaded: in flight requests may ask for it
    with pytest.raises(Exception, match="404|400|not found|does not exist"):
        await greedy(server, "r4-a8-step1")
