"""``POST /inference/v1/generate``'s request parsing and response shape (the route itself runs in the verifiers env
tests, where verifiers' train client calls it on the built-in server)."""

import pytest

from workers.inference.generate_api import generate_request, generate_response
from workers.inference.generation import Choice, Generation
from workers.inference.openai_api import ApiError


def test_a_renderers_style_request_parses_with_its_stop_ids_and_logprobs():
    ids, params = generate_request({"model": "m", "token_ids": [5, 6, 7], "cache_salt": "3", "sampling_params": {
        "temperature": 0.7, "max_tokens": 9, "stop_token_ids": [2, 4], "logprobs": 1, "skip_special_tokens": False,
        "top_k": 5}})
    assert ids == [5, 6, 7]
    assert (params.temperature, params.max_tokens, params.stop_token_ids, params.top_k) == (0.7, 9, (2, 4), 5)
    assert params.logprobs == 0  # the sampled token's logprob, no top-k list


def test_unset_max_tokens_means_the_context_limit():
    _, params = generate_request({"token_ids": [1], "sampling_params": {}})
    assert params.max_tokens is None


@pytest.mark.parametrize("body, error", [
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": ["a"]}, "token_ids"),
    ({"token_ids": [1], "sampling_params": {"best_of": 2}}, "best_of"),
    ({"token_ids": [1], "sampling_params": {"repetition_penalty": 1.2}}, "repetition_penalty"),
    ({"token_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
])
def test_bad_requests_name_the_field(body, error):
    with pytest.raises(ApiError, match=error):
        generate_request(body)


def test_logprob_entries_are_written_token_id_colon_n():
    gen = Generation([1, 2], None, [Choice([7, 9], [-0.5, -1.25], None, "xy", "stop", 9)], 4, 5)
    out = generate_response(gen, "tiny")
    choice = out["choices"][0]
    assert choice["token_ids"] == [7, 9] and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["content"] == [{"token": "token_id:7", "logprob": -0.5},
                                             {"token": "token_id:9", "logprob": -1.25}]
    assert (out["prompt_token_ids"], out["policy_version"], out["policy_version_end"]) == ([1, 2], 4, 5)
