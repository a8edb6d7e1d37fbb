"""The engine in-process: batching requests of different lengths, what cannot fit, calls between steps."""

import pytest
import torch

from workers.inference.engine import Engine
from workers.inference.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    eng = Engine(model, tok, max_batch_size=8, max_model_len=128, eos_token_ids={258})
    eng.start()
    yield eng
    eng.stop()


def test_engine_batches_requests_of_different_lengths_exactly(engine):
    """Requests joining a running batch (left-padded KV cache) get the logprobs of a plain forward pass."""
    prompts = [[65 + i] * (3 + 5 * i) for i in range(10)]  # 10 requests, batch of 8: some wait, some join late
    handles = [engine.submit(p, SamplingParams(temperature=0.8, max_tokens=20 + 3 * i, ignore_eos=True))
               for i, p in enumerate(prompts)]
    for h in handles:
        gen = h.future.result(timeout=120)
        ids = gen.prompt_token_ids + gen.choices[0].token_ids
        with torch.no_grad():
            logits = engine.model(torch.tensor([ids])).logits[0]
        lp = torch.log_softmax(logits / 0.8, -1)[len(gen.prompt_token_ids) - 1 : -1]
        expected = lp.gather(1, torch.tensor(gen.choices[0].token_ids)[:, None]).squeeze(1)
        assert len(gen.choices[0].token_ids) == h.params.max_tokens
        assert torch.allclose(torch.tensor(gen.choices[0].logprobs), expected, atol=1e-4)
    assert engine.active == 0


def test_engine_rejects_what_cannot_fit(engine):
    with pytest.raises(ValueError, match="max_model_len=128"):
        engine.submit([1] * 100, SamplingParams(max_tokens=50))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([100000], SamplingParams(max_tokens=5))


def test_engine_applies_calls_between_steps(engine):
    assert engine.call_between_steps(lambda: 41 + 1).result(timeout=10) == 42
