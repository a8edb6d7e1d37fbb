"""The inference server as a real process on the tiny model, against a real redis."""

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
import torch

from bus.local_redis import free_port
from bus.messages import WeightUpdate
from bus.policy import PolicyTracker
from tests.workers.inference.process import InferenceProcess
from trainer.weights import describe_weights, weights_dir
from workers.inference.client import InferenceClient
from workers.tools.init_model import build_model

SERVER_ID = "s1"


@pytest.fixture(scope="module")
def run(redis_server):
    return f"t-inf-{int(time.time() * 1000) % 10**8}"


@pytest.fixture(scope="module")
def output_dir(tmp_path_factory) -> Path:
    """The server's run.output_dir: it loads weights only from under output_dir/weights."""
    return tmp_path_factory.mktemp("inference-run")


@pytest.fixture(scope="module")
def server(tiny_model_dir, redis_server, run, tmp_path_factory, output_dir):
    tmp = tmp_path_factory.mktemp("inference")
    config = tmp / "cfg.toml"
    config.write_text(
        f'[run]\nname = "{run}"\noutput_dir = "{output_dir}"\n[redis]\nurl = "{redis_server}"\nblock_ms = 200\n'
        f'[model]\npath = "{tiny_model_dir}"\n[inference]\nnum_threads = 1\nmax_model_len = 512\n'
    )
    with InferenceProcess(config, free_port(), SERVER_ID, log_path=tmp / "server.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), AutoTokenizer.from_pretrained(tiny_model_dir)


async def _post(server, path, body):
    async with aiohttp.ClientSession() as s, s.post(server.base_url + path, json=body) as r:
        return r.status, await r.json()


def _forward_logprobs(model, ids: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
async def test_logprobs_are_log_softmax_at_the_temperature(server, model_and_tokenizer, temperature):
    model, tok = model_and_tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "abc"}], tokenize=True,
                                     add_generation_prompt=True, return_dict=False)

    async with InferenceClient([server.base_url]) as client:
        result = await client.completions(prompt, n=3, temperature=temperature, max_tokens=24, prompt_logprobs=True)
    assert result.prompt_token_ids == prompt and result.policy_version == 0
    for choice in result.choices:
        full = prompt + choice.token_ids
        logprobs = _forward_logprobs(model, full, temperature or 1.0)[len(prompt) - 1 : -1]
        expected = logprobs.gather(1, torch.tensor(choice.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(choice.logprobs), expected, atol=1e-4)
        if temperature == 0:
            assert choice.token_ids == logprobs.argmax(-1).tolist()
    raw = _forward_logprobs(model, prompt, 1.0)
    expected_prompt = raw[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    assert result.prompt_logprobs[0] is None
    assert torch.allclose(torch.tensor(result.prompt_logprobs[1:]), expected_prompt, atol=1e-4)


async def test_token_ids_round_trip_through_the_tokenizer(server, model_and_tokenizer):
    _, tok = model_and_tokenizer
    text = "héllo, wörld ✓"
    status, body = await _post(server, "/completions", {"prompt": text, "max_tokens": 16, "return_token_ids": True,
                                                    "temperature": 0.0, "stop_token_ids": []})
    assert status == 200
    choice = body["choices"][0]
    assert tok.decode(choice["prompt_token_ids"]) == text
    assert tok.encode(text, add_special_tokens=False) == choice["prompt_token_ids"]
    assert choice["text"] == tok.decode(choice["token_ids"], skip_special_tokens=True)
    assert body["usage"]["completion_tokens"] == len(choice["token_ids"])


async def test_chat_completion_fields_like_vllm(server, model_and_tokenizer):
    _, tok = model_and_tokenizer
    messages = [{"role": "user", "content": "hi"}]
    status, body = await _post(server, "/chat/completions", {
        "messages": messages, "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 2,
        "return_token_ids": True, "n": 2, "seed": 7, "ignore_eos": True,
    })
    assert status == 200 and body["policy_version"] == 0
    assert body["prompt_token_ids"] == tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                               return_dict=False)
    for choice in body["choices"]:
        assert len(choice["token_ids"]) == 5 and choice["finish_reason"] == "length"
        content = choice["logprobs"]["content"]
        assert len(content) == 5 and all(len(c["top_logprobs"]) == 2 for c in content)
    _, again = await _post(server, "/chat/completions", {"messages": messages, "max_completion_tokens": 5, "n": 2,
                                                   "seed": 7, "ignore_eos": True, "return_token_ids": True})
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in body["choices"]]


async def test_bad_requests_get_400_with_the_reason(server):
    status, body = await _post(server, "/completions", {"prompt": [1] * 600, "max_tokens": 4})
    assert status == 400 and "max_model_len=512" in body["error"]["message"]
    status, body = await _post(server, "/completions", {"prompt": "x", "temperature": -1})
    assert status == 400 and "temperature" in body["error"]["message"] and body["policy_version"] == 0


BAD_PARAMETERS = [
    ({"logprobs": 10**6}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"logprobs": "x"}, "logprobs"),
    ({"prompt_logprobs": 10**6}, "prompt_logprobs"), ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"top_k": -5}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"seed": 2**70}, "seed"), ({"seed": 1.5}, "seed"),
    ({"stop": [1]}, "stop"), ({"stop": [""]}, "stop"), ({"stop": {"a": 1}}, "stop"), ({"stop": ["x"] * 65}, "stop"),
    ({"stop_token_ids": [1] * 100_000}, "stop_token_ids"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"), ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"n": 2.5}, "n"), ({"n": 10**6}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "9"}, "max_tokens"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": 1e9}, "temperature"),
    ({"top_p": float("nan")}, "top_p"), ({"top_p": 0}, "top_p"), ({"min_p": 2}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"prompt": [[1, "a"]]}, "prompt"), ({"prompt": [-3]}, "prompt"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_PARAMETERS, ids=[str(f) for f, _ in BAD_PARAMETERS])
async def test_every_sampling_parameter_out_of_range_is_a_400_that_names_it(server, fields, param):
    """Each used to crash the engine (logprobs, prompt_logprobs, seed, stop), pass silently (NaN temperature, 2.5
    choices) or give a 500; now a 400 whose message and ``param`` name the field, and the server goes on serving."""
    status, body = await _post(server, "/completions", {"prompt": [65, 66], "max_tokens": 4, **fields})
    assert status == 400, body
    assert body["error"]["param"] == param and param in body["error"]["message"]
    status, body = await _post(server, "/completions", {"prompt": [65, 66], "max_tokens": 2})
    assert status == 200 and len(body["choices"]) == 1


async def test_chat_top_logprobs_out_of_range_is_a_400(server):
    status, body = await _post(server, "/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                                       "logprobs": True, "top_logprobs": 10**6, "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "top_logprobs"


async def test_stop_strings_end_the_completion(server):
    status, body = await _post(server, "/completions", {"prompt": "abc", "max_tokens": 64, "temperature": 1.0,
                                                    "seed": 3, "return_token_ids": True, "ignore_eos": True})
    text = body["choices"][0]["text"]
    stop = next((ch for ch in text[3:] if ch.isprintable() and ch != "\ufffd"), None)
    if stop is None:
        pytest.skip("sampled text has no printable character to stop on")
    status, body = await _post(server, "/completions", {"prompt": "abc", "max_tokens": 64, "temperature": 1.0,
                                                    "seed": 3, "return_token_ids": True, "ignore_eos": True,
                                                    "stop": [stop]})
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert stop not in choice["text"] and text.startswith(choice["text"])


def test_the_openai_client_streams_completions_as_they_are_sampled(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="unused")
    ask = dict(model="m", prompt=["abc", "xyz"], max_tokens=24, temperature=1.0, seed=5, n=2,
               extra_body={"ignore_eos": True})  # vLLM's field, passed as the openai client passes it
    plain = client.completions.create(**ask)
    chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    for choice in plain.choices:  # the same seeded samples, in pieces
        pieces = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(p.text for p in pieces) == choice.text
        assert len([p for p in pieces if p.text]) > 1
        assert [p.finish_reason for p in pieces][-1] == choice.finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens == 4 * 24
    text = plain.choices[0].text
    at = next((i for i in range(3, len(text) - 1) if text[i:i + 2].isprintable() and "\ufffd" not in text[i:i + 2]
               and text.find(text[i:i + 2]) == i), None)
    if at is None:
        pytest.skip("sampled text has no printable pair to stop on")
    with_stop = client.completions.create(**{**ask, "stop": [text[at:at + 2]]}, stream=True)
    texts: dict[int, str] = {}
    for chunk in with_stop:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts[0] == text[:at]  # nothing of the two-character stop string was sent


def test_the_openai_client_streams_chat(server):
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=server.base_url, api_key="unused")
    ask = dict(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0)
    plain = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    with pytest.raises(BadRequestError, match="stream=true streams text only; drop logprobs"):
        client.chat.completions.create(**ask, stream=True, logprobs=True)


async def test_concurrent_requests_are_batched(server):
    """Ten concurrent requests of 96 tokens share decode steps: the engine takes under a third of the ~950 steps it
    takes for them one after another (counted by the server, so a pause in this process cannot tip it)."""
    body = {"max_tokens": 96, "ignore_eos": True, "temperature": 1.0}

    async with InferenceClient([server.base_url]) as client, aiohttp.ClientSession() as http:
        await client.completions([65, 66], max_tokens=4)  # warm up (model name, connection)
        async with http.get(f"http://127.0.0.1:{server.port}/health") as r:
            before = await r.json()
        results = await asyncio.gather(*(client.completions([65 + i, 66], extra_body=body) for i in range(10)))
        async with http.get(f"http://127.0.0.1:{server.port}/health") as r:
            after = await r.json()
        assert all(len(r.choices[0].token_ids) == 96 for r in results)
    steps, tokens = after["steps"] - before["steps"], after["generated_tokens"] - before["generated_tokens"]
    assert tokens == 960 and steps <= 960 / 3, f"{tokens} tokens in {steps} decode steps"


async def test_weight_update_changes_greedy_output_and_served_follows(server, bus, run, output_dir,
                                                                      model_and_tokenizer):
    """Runs last in this module: it moves the shared server to version 1."""
    from transformers import AutoModelForCausalLM

    _, tok = model_and_tokenizer
    new_dir = build_model(weights_dir(output_dir, 1), preset="tiny", seed=1)
    new_model = AutoModelForCausalLM.from_pretrained(new_dir).eval()
    prompt = tok.encode("reverse me", add_special_tokens=False)
    expected = list(prompt)
    for _ in range(12):
        expected.append(int(_forward_logprobs(new_model, expected, 1.0)[-1].argmax()))
    expected = expected[len(prompt):]
    greedy = {"prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}

    _, before = await _post(server, "/completions", greedy)
    assert before["policy_version"] == 0 and before["choices"][0]["token_ids"] != expected

    async with bus("trainer", run=run) as b:
        tracker = PolicyTracker(b)
        await tracker.wait(lambda t: t.served_by.get(SERVER_ID) == 0, timeout_s=10)
        event = WeightUpdate(step=1, format="safetensors", dir=str(new_dir), files=describe_weights(new_dir))
        await b.publish(b.keys.weights(), event)
        await tracker.wait(lambda t: t.served_by.get(SERVER_ID) == 1, timeout_s=30)
    _, after = await _post(server, "/completions", greedy)
    assert after["policy_version"] == 1
    assert after["choices"][0]["token_ids"] == expected


async def test_gloo_broadcast_update_is_loaded_in_place(server, bus, run, tmp_path, model_and_tokenizer):
    """After the safetensors update (version 1): a gloo broadcast of other weights as version 2."""
    from transformers import AutoModelForCausalLM

    from trainer.broadcast import WeightBroadcaster

    new_model = AutoModelForCausalLM.from_pretrained(build_model(tmp_path / "m2", seed=2)).eval()
    prompt = [104, 105]
    expected = list(prompt)
    for _ in range(8):
        expected.append(int(_forward_logprobs(new_model, expected, 1.0)[-1].argmax()))
    sender = WeightBroadcaster("127.0.0.1", free_port(), receivers=1, device=torch.device("cpu"), timeout_s=60)
    state = new_model.state_dict()
    event = sender.event(2, state)

    async with bus("trainer", run=run) as b:
        await b.publish(b.keys.weights(), event)
        await asyncio.to_thread(sender.broadcast, event, state)
        await PolicyTracker(b).wait(lambda t: t.served_by.get(SERVER_ID) == 2, timeout_s=30)
    _, after = await _post(server, "/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0.0,
                                              "ignore_eos": True, "return_token_ids": True})
    assert after["policy_version"] == 2 and after["choices"][0]["token_ids"] == expected[2:]


async def test_metrics_count_the_tokens_sampled_and_name_the_server(server, run):
    async def scrape(http) -> dict[str, float]:
        async with http.get(f"http://127.0.0.1:{server.port}/metrics") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            text = await r.text()
        labels = f'{{run="{run}",server="{SERVER_ID}"}}'
        return {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines() if labels in line}

    async with InferenceClient([server.base_url]) as client, aiohttp.ClientSession() as http:
        before = await scrape(http)
        await client.completions([65, 66], n=2, max_tokens=7, extra_body={"ignore_eos": True})
        after = await scrape(http)
    assert after["rlbus_inference_generated_tokens_total"] - before["rlbus_inference_generated_tokens_total"] == 14
    assert after["rlbus_inference_queued_requests"] == 0 and after["rlbus_inference_running_sequences"] == 0
    assert "rlbus_inference_policy_version" in after and after["rlbus_inference_decode_steps_total"] > 0


async def test_a_server_whose_engine_keeps_failing_exits_for_its_supervisor(tiny_model_dir, tmp_path, monkeypatch):
    """Each failed step is a 500 (the client retries); after three in a row the engine stops, requests get 503 with
    Retry-After, /health says engine_dead, and ``run()`` raises within a second or two, so the process exits and
    its supervisor starts a fresh one (a poisoned CUDA context cannot be cleared in place)."""
    from workers.config_loader import load_config
    from workers.inference.transformers_server import InferenceServer

    path = tmp_path / "cfg.toml"
    path.write_text(f'[run]\noutput_dir = "{tmp_path}"\n[model]\npath = "{tiny_model_dir}"\n'
                    '[inference]\nnum_threads = 1\nmax_model_len = 256\n')
    server = InferenceServer(load_config([path], []), "127.0.0.1", free_port(), "dying")
    await server.setup()
    try:
        def broken(*args, **kwargs):
            raise RuntimeError("CUDA error: device-side assert triggered (simulated)")

        monkeypatch.setattr(server.engine.model, "forward", broken)
        running = asyncio.create_task(server.run())
        url = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as http:
            statuses = []
            for _ in range(4):
                async with http.post(url + "/v1/completions", json={"prompt": [65], "max_tokens": 2}) as r:
                    statuses.append((r.status, r.headers.get("Retry-After")))
            assert statuses[:3] == [(500, None)] * 3 and statuses[3] == (503, "1")
            async with http.get(url + "/health") as r:
                assert r.status == 503 and (await r.json())["status"] == "engine_dead"
        with pytest.raises(RuntimeError, match="inference engine stopped"):
            await asyncio.wait_for(running, timeout=5)
    finally:
        await server.close()


async def test_a_body_that_is_no_json_gets_400_and_the_server_goes_on(server):
    async with aiohttp.ClientSession() as session, session.post(
            server.base_url + "/completions", data=b'{"prompt": [1, 2', headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 400 and "invalid JSON body" in (await r.json())["error"]["message"]
    status, body = await _post(server, "/completions", {"prompt": [1, 2], "max_tokens": 2, "ignore_eos": True,
                                                    "return_token_ids": True})
    assert status == 200 and len(body["choices"][0]["token_ids"]) == 2
