"""The inference client: retries, round robin, headers, vLLM-shaped responses."""


import pytest

from bus.local_redis import free_port
from workers.inference.client import InferenceClient, InferenceUnavailableError, _headers, _parse_completion


async def test_client_retries_then_names_the_servers():
    urls = [f"http://127.0.0.1:{free_port()}/v1"]
    with pytest.raises(InferenceUnavailableError, match="127.0.0.1"):
        async with InferenceClient(urls, timeout_s=2, max_retries=2, backoff_s=0.01) as client:
            await client.completions([1, 2, 3], max_tokens=2)


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
