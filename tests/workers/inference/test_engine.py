"""The engine in-process: batching requests of different lengths, what cannot fit, calls between steps."""

import time

import pytest
import torch

from workers.inference.engine import FAILURES_IN_A_ROW, Engine
from workers.inference.engine_errors import EngineOverloaded, EngineStepFailed, EngineStopped
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


def _fresh_engine(engine, **kw) -> Engine:
    """A second engine over the module's model and tokenizer (these tests break or fill it)."""
    eng = Engine(engine.model, engine.tokenizer, max_batch_size=4, max_model_len=128, eos_token_ids={258}, **kw)
    eng.start()
    return eng


def _fail_forward(monkeypatch, eng: Engine, times: int) -> list[int]:
    """The next ``times`` forward passes of ``eng`` raise (a device error, say); returns the call count."""
    calls = [0]
    forward = eng.model.forward

    def broken(*args, **kwargs):
        calls[0] += 1
        if calls[0] <= times:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        return forward(*args, **kwargs)

    monkeypatch.setattr(eng.model, "forward", broken)
    return calls


def test_a_failed_prefill_fails_its_requests_at_once_and_the_engine_goes_on(engine, monkeypatch):
    """It used to leave the prefilled requests waiting forever (and the engine dead)."""
    eng = _fresh_engine(engine)
    try:
        _fail_forward(monkeypatch, eng, times=1)
        handle = eng.submit([65, 66], SamplingParams(max_tokens=4))
        with pytest.raises(EngineStepFailed, match="illegal memory access"):
            handle.future.result(timeout=10)
        assert eng.alive and eng.failures == 1
        again = eng.submit([65, 66], SamplingParams(max_tokens=4, ignore_eos=True)).future.result(timeout=30)
        assert len(again.choices[0].token_ids) == 4
    finally:
        eng.stop()


def test_an_engine_that_keeps_failing_stops_and_fails_every_request(engine, monkeypatch):
    """Three failed steps in a row (a broken device): the engine thread ends, every request fails, the server
    watching it exits for its supervisor to restart it."""
    eng = _fresh_engine(engine)
    try:
        _fail_forward(monkeypatch, eng, times=10**6)
        handles = [eng.submit([65 + i, 66], SamplingParams(max_tokens=4)) for i in range(12)]  # 3 batches at least
        for h in handles:
            with pytest.raises(RuntimeError):
                h.future.result(timeout=10)
        eng._thread.join(timeout=10)
        assert not eng.alive and eng.failures == FAILURES_IN_A_ROW
        with pytest.raises(EngineStopped):
            eng.submit([65], SamplingParams(max_tokens=1))
    finally:
        eng.stop()


def test_queued_sequences_are_bounded(engine):
    """Past ``max_queued`` waiting sequences a request is refused whole (the server answers 429); one asking for
    more than the bound on its own can never fit (400)."""
    eng = Engine(engine.model, engine.tokenizer, max_batch_size=4, max_model_len=128, eos_token_ids={258},
                 max_queued=8)  # not started: nothing leaves the queue
    params = SamplingParams(max_tokens=2, n=2)
    eng.submit_all([[65]] * 4, params)
    with pytest.raises(EngineOverloaded, match="8"):
        eng.submit_all([[66]], params)
    with pytest.raises(ValueError, match="max_queued_sequences=8"):
        eng.submit_all([[67]] * 5, params)
    assert eng.queued_sequences == 8


def test_an_idle_engine_prefills_requests_arriving_close_together_in_one_pass(engine):
    """A rollout worker's groups arrive a few ms apart; each used to be prefilled (and then decoded) on its own."""
    eng = _fresh_engine(engine, batch_wait_s=0.5)
    try:
        first = eng.submit([65, 66], SamplingParams(max_tokens=3))
        time.sleep(0.05)
        second = eng.submit([67], SamplingParams(max_tokens=3))
        for handle in (first, second):
            assert len(handle.future.result(timeout=30).choices[0].token_ids) == 3
        assert eng.prefills == 1 and eng.steps == 2
    finally:
        eng.stop()


def test_a_full_batch_or_a_call_between_steps_ends_the_wait(engine):
    eng = _fresh_engine(engine, batch_wait_s=60.0)
    try:
        full = eng.submit([66], SamplingParams(max_tokens=2, n=4))  # max_batch_size=4: nothing else could join
        full.future.result(timeout=10)
        alone = eng.submit([65], SamplingParams(max_tokens=2))
        assert eng.call_between_steps(lambda: "ran").result(timeout=10) == "ran"  # new weights never wait
        alone.future.result(timeout=10)
        assert eng.prefills == 2
    finally:
        eng.stop()


def test_requests_held_for_company_are_not_reported_waiting_for_room(engine):
    """``waiting`` (the /health ``queued`` the adaptive rollout concurrency reads) counts sequences no free slot will
    take; a request held by an idle engine for company has its slot, and must not look like a growing queue."""
    eng = _fresh_engine(engine, batch_wait_s=60.0)
    try:
        held = eng.submit([65], SamplingParams(max_tokens=2, n=2))
        assert eng.queued_sequences == 2 and eng.waiting == 0
        eng.submit([66], SamplingParams(max_tokens=2, n=2)).future.result(timeout=10)  # 4 fill the batch
        held.future.result(timeout=10)
    finally:
        eng.stop()
    full = Engine(engine.model, engine.tokenizer, max_batch_size=4, max_model_len=128, eos_token_ids={258})
    full.submit_all([[65]] * 3, SamplingParams(max_tokens=2, n=2))  # not started: 6 queued, room for 4
    assert full.waiting == 2
