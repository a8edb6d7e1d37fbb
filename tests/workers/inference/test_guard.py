"""What guards the built-in server against its clients: the API key, the queue bound, disconnects, and the counts
of what it refused (a real server process on the tiny model, against a real redis)."""

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
import redis

from bus.keys import Keys
from bus.local_redis import free_port
from bus.messages import Metric, WeightUpdate
from bus.policy import PolicyTracker
from tests.workers.inference.process import InferenceProcess
from trainer.weights import describe_weights, weights_dir
from workers.inference.client import InferenceClient, InferenceRequestError
from workers.tools.init_model import build_model

KEY_VAR = "RLBUS_TEST_INFERENCE_KEY"
KEY = "s3cret-key"
LONG = {"prompt": [65, 66], "max_tokens": 3000, "ignore_eos": True, "temperature": 1.0}
"""A request that decodes for many seconds on the tiny model."""


@pytest.fixture(scope="module")
def run(redis_server) -> str:
    return f"t-guard-{int(time.time() * 1000) % 10**8}"


@pytest.fixture(scope="module")
def output_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("guard")


@pytest.fixture(scope="module")
def server(tiny_model_dir, redis_server, run, output_dir):
    tmp = output_dir
    config = tmp / "cfg.toml"
    config.write_text(
        f'[run]\nname = "{run}"\noutput_dir = "{tmp}"\n[redis]\nurl = "{redis_server}"\nblock_ms = 200\n'
        f'[model]\npath = "{tiny_model_dir}"\n'
        f'[inference]\nnum_threads = 1\nmax_model_len = 4096\nmax_batch_size = 2\nmax_queued_sequences = 4\n'
        f'api_key_var = "{KEY_VAR}"\n'
    )
    proc = InferenceProcess(config, free_port(), "guard", log_path=tmp / "server.log")
    proc.env[KEY_VAR] = KEY
    with proc:  # starts it once (`with proc.start()` started a second server, left running unreferenced)
        yield proc


def _auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _health(http: aiohttp.ClientSession, server) -> dict:
    async with http.get(f"http://127.0.0.1:{server.port}/health") as r:
        return await r.json()


async def test_v1_routes_need_the_api_key_and_health_stays_open(server, monkeypatch):
    """vLLM's ``--api-key`` convention: ``Authorization: Bearer KEY`` on /v1, else 401; /health stays open for the
    supervisors that probe it. The rollout client sends the key from ``inference.api_key_var``."""
    body = {"prompt": [65, 66], "max_tokens": 2}
    async with aiohttp.ClientSession() as http:
        for headers in ({}, _auth("wrong"), {"Authorization": KEY}):
            async with http.post(server.base_url + "/completions", json=body, headers=headers) as r:
                assert r.status == 401 and "API key" in (await r.json())["error"]["message"]
        async with http.get(server.base_url + "/models") as r:
            assert r.status == 401
        async with http.post(server.base_url + "/completions", json=body, headers=_auth()) as r:
            assert r.status == 200
        assert (await _health(http, server))["status"] == "ok"
    monkeypatch.setenv(KEY_VAR, KEY)
    async with InferenceClient([server.base_url], api_key_var=KEY_VAR) as client:
        assert len((await client.completions([65], max_tokens=2)).choices) == 1
    monkeypatch.setenv(KEY_VAR, "wrong")
    async with InferenceClient([server.base_url], api_key_var=KEY_VAR, max_retries=0) as client:
        with pytest.raises(InferenceRequestError, match="401"):
            await client.completions([65], max_tokens=2)


async def _wait_health(http, server, predicate, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        health = await _health(http, server)
        if predicate(health) or time.monotonic() > deadline:
            return health
        await asyncio.sleep(0.1)


async def test_a_client_that_disconnects_frees_its_rows(server):
    """A non-streamed request whose client goes away stops decoding within a step or two (it used to decode to
    max_tokens, holding its rows)."""
    async with aiohttp.ClientSession(headers=_auth()) as http:
        async with aiohttp.ClientSession(headers=_auth()) as doomed:
            pending = asyncio.create_task(doomed.post(server.base_url + "/completions", json={**LONG, "n": 2}))
            health = await _wait_health(http, server, lambda h: h["active"] == 2, 30)
            assert health["active"] == 2
            pending.cancel()
        health = await _wait_health(http, server, lambda h: h["active"] == 0, 5)
        assert health["active"] == 0, health
        tokens = health["generated_tokens"]
        await asyncio.sleep(1.0)
        health = await _health(http, server)
        assert health["generated_tokens"] == tokens and health["counts"]["requests_disconnected"] >= 1


async def test_a_full_queue_is_answered_429_with_retry_after(server):
    """Two rows decode (max_batch_size 2) and four wait (max_queued_sequences 4): the next request is refused with
    429 and Retry-After until room frees; one that could never fit is a 400."""
    async with aiohttp.ClientSession(headers=_auth()) as http:
        busy = [asyncio.create_task(http.post(server.base_url + "/completions", json={**LONG, "n": 2}))]
        try:
            health = await _wait_health(http, server, lambda h: h["active"] == 2, 30)
            busy += [asyncio.create_task(http.post(server.base_url + "/completions", json={**LONG, "n": 2}))
                     for _ in range(2)]
            health = await _wait_health(http, server, lambda h: h["queued"] == 4, 30)
            assert health["active"] == 2 and health["queued"] == 4, health
            async with http.post(server.base_url + "/completions", json={"prompt": [65], "max_tokens": 1}) as r:
                assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
                assert "max_queued_sequences=4" in (await r.json())["error"]["message"]
            async with http.post(server.base_url + "/completions",
                                 json={"prompt": [[65]] * 5, "max_tokens": 1}) as r:
                assert r.status == 400
        finally:
            for task in busy:
                task.cancel()
        health = await _wait_health(http, server, lambda h: h["active"] == h["queued"] == 0, 10)
        assert health["active"] == health["queued"] == 0
        assert health["counts"]["rejected_overloaded"] >= 1
        async with http.post(server.base_url + "/completions", json={"prompt": [65], "max_tokens": 1}) as r:
            assert r.status == 200


async def test_refusals_are_counted_in_the_metrics_stream(server, redis_server, run):
    """Bad requests, 401s and 429s show up as ``inference/*`` values of a ``Metric(source="inference")`` entry."""
    async with aiohttp.ClientSession(headers=_auth()) as http:
        async with http.post(server.base_url + "/completions", json={"prompt": [65], "top_k": 2.5}) as r:
            assert r.status == 400
    r = redis.Redis.from_url(redis_server)
    deadline = time.monotonic() + 20
    totals: dict[str, float] = {}
    while time.monotonic() < deadline and not totals.get("inference/rejected_bad_request"):
        totals = {}
        for _, fields in r.xrange(Keys(run).metrics()):
            metric = Metric.from_fields(fields)
            if metric.source == "inference":
                for name, value in metric.values.items():
                    totals[name] = totals.get(name, 0.0) + value
        time.sleep(0.5)
    assert totals.get("inference/rejected_bad_request", 0) >= 1
    assert totals.get("inference/rejected_unauthorized", 0) >= 1


async def test_weights_that_fail_to_load_leave_the_last_good_ones_serving(server, output_dir, bus, run):
    """A folder whose shard is garbage but whose event carries that garbage's sha256 (what re-publishing a damaged
    folder used to do) made the loader's error kill the server. Now the update is skipped (logged, counted) and the
    server goes on serving version 0, then loads the next good update."""
    bad = weights_dir(output_dir, 1)
    bad.mkdir(parents=True)
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}" + bytes(64))
    async with bus("trainer", run=run) as b, aiohttp.ClientSession(headers=_auth()) as http:
        await b.publish(b.keys.weights(), WeightUpdate(step=1, format="safetensors", dir=str(bad),
                                                       files=describe_weights(bad)))
        health = await _wait_health(http, server, lambda h: h["counts"]["weights_load_failed"] >= 1, 30)
        assert health["counts"]["weights_load_failed"] == 1 and health["status"] == "ok"
        async with http.post(server.base_url + "/completions", json={"prompt": [65], "max_tokens": 2}) as r:
            assert r.status == 200 and (await r.json())["policy_version"] == 0
        good = build_model(weights_dir(output_dir, 2), preset="tiny", seed=1)
        await b.publish(b.keys.weights(), WeightUpdate(step=2, format="safetensors", dir=str(good),
                                                       files=describe_weights(good)))
        await PolicyTracker(b).wait(lambda t: t.served_by.get("guard") == 2, timeout_s=30)
