"""Pieces of the inference server that need no server: sampling, the engine in-process, the client, vLLM args."""

import asyncio

import pytest
import torch

from bus.local_redis import free_port
from workers.config import RlbusConfig
from workers.inference.client import InferenceClient, InferenceUnavailableError, _headers, _parse_completion
from workers.inference.engine import Engine
from workers.inference.sampling import RowParams, SamplingParams, sample
from workers.inference.vllm_launcher import vllm_command, vllm_env
from workers.inference.weights_follower import _collapse


def _rows(*params: SamplingParams, seeds=None) -> RowParams:
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in (seeds or [None] * len(params))]
    return RowParams.build(list(params), gens)


def test_sampled_logprobs_are_the_full_distribution_at_the_temperature():
    logits = torch.randn(3, 50)
    tokens, chosen, full = sample(logits, _rows(SamplingParams(temperature=0.5), SamplingParams(top_k=3),
                                                SamplingParams(temperature=0.0)))
    expected = torch.log_softmax(logits / torch.tensor([0.5, 1.0, 1.0])[:, None], -1)
    assert torch.allclose(full, expected)
    assert torch.allclose(chosen, expected.gather(1, tokens[:, None]).squeeze(1))
    assert tokens[1] in logits[1].topk(3).indices and tokens[2] == logits[2].argmax()


def test_top_p_and_min_p_restrict_the_draws():
    logits = torch.tensor([[4.0, 3.9, 0.0, -1.0, -2.0]] * 200)
    tokens, _, _ = sample(logits, _rows(*[SamplingParams(top_p=0.5)] * 100, *[SamplingParams(min_p=0.5)] * 100))
    assert set(tokens[:100].tolist()) <= {0, 1} and set(tokens[100:].tolist()) <= {0, 1}


def test_seeded_rows_repeat_and_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    draws = [sample(logits, _rows(SamplingParams(), seeds=[s]))[0].item() for s in range(2000)]
    assert abs(draws.count(0) / 2000 - 0.7) < 0.05
    again = [sample(logits, _rows(SamplingParams(), seeds=[s]))[0].item() for s in range(50)]
    assert again == draws[:50]


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


def test_client_retries_then_names_the_servers():
    urls = [f"http://127.0.0.1:{free_port()}/v1"]

    async def go():
        async with InferenceClient(urls, timeout_s=2, max_retries=2, backoff_s=0.01) as client:
            await client.completions([1, 2, 3], max_tokens=2)

    with pytest.raises(InferenceUnavailableError, match="127.0.0.1"):
        asyncio.run(go())


def test_client_round_robin_and_headers(monkeypatch):
    client = InferenceClient(["http://a/v1", "http://b/v1/"])
    assert [client.pick_server() for _ in range(3)] == [0, 1, 0] and client.base_urls[1] == "http://b/v1"
    monkeypatch.setenv("MY_KEY", "sekrit")
    monkeypatch.setenv("ORG", "acme")
    assert _headers("MY_KEY", {"X-Org": "ORG"}) == {"Authorization": "Bearer sekrit", "X-Org": "acme"}
    with pytest.raises(ValueError, match="NOT_SET_VAR"):
        _headers("NOT_SET_VAR", {})


def test_client_reads_vllm_shaped_responses():
    data = {"choices": [{"index": 0, "text": "hi", "finish_reason": "length", "token_ids": [5, 6],
                         "logprobs": {"token_logprobs": [-0.5, -1.5]}, "prompt_token_ids": [1, 2],
                         "prompt_logprobs": [None, {"2": {"logprob": -3.0, "rank": 4, "decoded_token": "x"},
                                                    "9": {"logprob": -0.1, "rank": 1, "decoded_token": "y"}}]}]}
    result = _parse_completion(data, [1, 2])
    assert result.choices[0].token_ids == [5, 6] and result.choices[0].logprobs == [-0.5, -1.5]
    assert result.prompt_logprobs == [None, -3.0] and result.policy_version is None


def test_vllm_command_and_env(tmp_path):
    config = RlbusConfig.model_validate({"model": {"path": "/m"}, "run": {"output_dir": str(tmp_path)},
                                         "inference": {"vllm_args": ["--seed", "1"], "num_threads": 2}})
    cmd = vllm_command(config, "127.0.0.1", 8001)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--enforce-eager" in cmd
    assert cmd[cmd.index("--model") + 1] == "/m" and cmd[-2:] == ["--seed", "1"]
    env = vllm_env(config)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"


def test_weight_events_collapse_but_broadcasts_are_all_joined():
    from bus.messages import WeightUpdate

    s = [WeightUpdate(step=i, format="safetensors", dir=f"/w/{i}") for i in range(1, 4)]
    n = WeightUpdate(step=4, format="nccl", host="h", port=1, world_size=2)
    assert [e.step for e in _collapse([s[0], s[1], n, s[2]])] == [2, 4, 3]


def test_eval_hold_keeps_newer_safetensors_updates_back(bus, run_name):
    """eval:hold=1: step 1 is served, step 2 waits (also for a follower started later) until the hold moves to 2;
    nccl broadcasts are never held."""
    from bus.messages import WeightUpdate
    from bus.state import EVAL_HOLD_FIELD
    from workers.inference.weights_follower import WeightsFollower

    async def main():
        async with bus("trainer") as b:
            await b.state_set(**{EVAL_HOLD_FIELD: 1})
            ids = [await b.publish(b.keys.weights(), WeightUpdate(step=s, format="safetensors", dir=f"/w/{s}"))
                   for s in (1, 2)]
            applied: dict[str, list[int]] = {"early": [], "late": []}

            def follower(name: str) -> WeightsFollower:
                async def apply(event: WeightUpdate) -> None:
                    applied[name].append(event.step)

                return WeightsFollower(b, name, apply, block_ms=100)

            async def until(expected: dict) -> None:
                for _ in range(50):
                    if applied == expected:
                        return
                    await asyncio.sleep(0.05)
                assert applied == expected

            early, late = follower("early"), follower("late")
            tasks = [asyncio.create_task(early.run())]
            await late.start()  # catches up to the newest event that is not held: step 1
            tasks.append(asyncio.create_task(late.run()))
            await asyncio.sleep(0.5)
            assert applied == {"early": [1], "late": [1]} and early.step == late.step == 1
            assert early.last_id == late.last_id == ids[0]  # not past the held step 2
            await b.state_set(**{EVAL_HOLD_FIELD: 2})
            await until({"early": [1, 2], "late": [1, 2]})
            await b.publish(b.keys.weights(), WeightUpdate(step=3, format="nccl", host="h", port=1, world_size=3))
            await until({"early": [1, 2, 3], "late": [1, 2, 3]})
            for task in tasks:
                task.cancel()

    asyncio.run(main())
