"""The rollout worker against real servers: redis, env servers and the built-in inference server (tiny model)."""

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import redis
from aiohttp import web
from structlog.testing import capture_logs

from bus.keys import GROUP_ROLLOUT, Keys
from bus.local_redis import free_port
from bus.messages import DeadLetter, RolloutGroup, Task
from bus.rpc import RpcClient
from bus.state import INFLIGHT_FIELD
from workers.config_loader import load_config
from workers.stages.rollout import RolloutWorker


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


class Stack:
    """One run with one inference server; each test writes its own config (its own env names)."""

    def __init__(self, tmp: Path, redis_url: str, model_dir: Path):
        self.tmp, self.redis_url, self.model_dir = tmp, redis_url, model_dir
        self.run = f"t-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.keys = Keys(self.run)
        self.redis = redis.Redis.from_url(redis_url)
        self.procs: list[subprocess.Popen] = []

    def config(self, envs: list[dict], claim_idle_ms: int = 60_000, **rollout) -> Path:
        sections = {
            "run": {"name": self.run},
            "redis": {"url": self.redis_url, "block_ms": 100, "claim_idle_ms": claim_idle_ms},
            "model": {"path": str(self.model_dir)},
            "sampling": {"max_completion_tokens": 12},
            "inference": {"port": self.port, "base_urls": [f"http://127.0.0.1:{self.port}/v1"], "max_model_len": 512,
                          "num_threads": 1, "max_retries": 0},
            "rollout": {"retry_delay_s": 0.05, **rollout},
        }
        text = "".join(f"[{name}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in body.items())
                       for name, body in sections.items())
        text += "".join("[[env]]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in env.items()) for env in envs)
        path = self.tmp / f"{uuid.uuid4().hex[:6]}.toml"
        path.write_text(text)
        return path

    def spawn(self, role: str, config: Path, *args: str) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with open(self.tmp / f"{role}-{len(self.procs)}.log", "w") as log:  # the child keeps its own copy
            proc = subprocess.Popen([sys.executable, "-m", "workers.cli", role, "@", str(config), *args],
                                    stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append(proc)
        return proc

    def publish(self, tasks: list[Task], inflight: int = 0) -> None:
        for task in tasks:
            self.redis.xadd(self.keys.tasks(task.env), task.to_fields())
        if inflight:
            self.redis.hincrby(self.keys.state(), INFLIGHT_FIELD, inflight)

    def groups(self, env: str) -> list[RolloutGroup]:
        return [RolloutGroup.from_fields(f) for _, f in self.redis.xrange(self.keys.rollouts(env))]

    def dead(self) -> list[DeadLetter]:
        return [DeadLetter.from_fields(f) for _, f in self.redis.xrange(self.keys.dead())]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.redis.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_server, tiny_model_dir):
    s = Stack(tmp_path_factory.mktemp("rollout"), redis_server, tiny_model_dir)
    s.spawn("inference", s.config([]), "--server-id", "s0")
    deadline = time.monotonic() + 180
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{s.port}/health", timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline or s.procs[0].poll() is not None:
                s.close()
                pytest.fail(f"inference server did not come up; log: {(s.tmp / 'inference-0.log').read_text()[-3000:]}")
            time.sleep(0.5)
    yield s
    s.close()


def _task(env: str, index: int, group_size: int, **kw) -> Task:
    return Task(task_id=f"{env}:0:{index}", env=env, example_index=index, example_id=str(index),
                group_size=group_size, **kw)


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.1)


async def test_multi_turn_groups_and_a_failing_task(stack):
    """guess_number episodes: env tokens masked, logprobs those of the served model; a task that keeps
    failing is dead-lettered after max_retries with its error, a task naming an env this worker does not serve
    is dead-lettered at once, both give their samples back, and the worker carries on."""
    # 128 tokens: the random model ends ~60% of its turns with an eos, so some of the 12 episodes surely go on.
    env = {"id": "guess_number", "name": f"gn{uuid.uuid4().hex[:4]}", "group_size": 4, "max_turns": 3,
           "max_retries": 2, "args": {"num_examples": 10}, "sampling": {"max_completion_tokens": 128}}
    config = load_config([stack.config([env])], [])
    name = env["name"]
    stack.publish([_task(name, 10_000, 4)] + [_task(name, i, 4) for i in (1, 2, 3)], inflight=16)
    stack.redis.xadd(stack.keys.tasks(name), _task("elsewhere", 7, 2).to_fields())
    stack.redis.hincrby(stack.keys.state(), INFLIGHT_FIELD, 2)

    worker = RolloutWorker(config, worker="r-inproc")
    await worker.setup()
    running = asyncio.create_task(worker.run())
    deadline = time.monotonic() + 120
    while len(stack.groups(name)) < 3 and time.monotonic() < deadline and not running.done():
        await asyncio.sleep(0.1)
    worker.request_stop()
    await running
    await worker.close()
    unserved, failing = sorted(stack.dead(), key=lambda d: "IndexError" in d.reason)
    assert "'elsewhere', which is not configured here" in unserved.reason
    assert failing.stream == stack.keys.tasks(name)
    assert "IndexError" in failing.reason and "after 3 attempts" in failing.reason
    assert Task.from_fields(failing.fields).example_index == 10_000
    assert int(stack.redis.hget(stack.keys.state(), INFLIGHT_FIELD)) == 12  # both dead tasks' 4 + 2 samples released
    assert stack.redis.xpending(stack.keys.tasks(name), GROUP_ROLLOUT)["pending"] == 0

    groups = stack.groups(name)
    assert sorted(g.task_id for g in groups) == [f"{name}:0:{i}" for i in (1, 2, 3)]
    _check_samples(groups, stack.model_dir)


def _check_samples(groups: list[RolloutGroup], model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    end, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    multi_turn = 0
    for group in groups:
        assert len(group.samples) == 4 and group.timings["total_s"] > 0
        assert set(group.timings) >= {"wait_gate_s", "generate_s", "env_s", "score_s", "total_s"}
        for s in group.samples:
            n = len(s.completion_ids)
            assert len(s.loss_mask) == len(s.completion_logprobs) == n and s.loss_mask[0]
            assert np.all(s.completion_logprobs[~s.loss_mask] == 0)
            assert s.policy_version_start == s.policy_version_end == 0
            assert 0.0 <= s.reward <= 1.0 and set(s.metrics) == {"guess", "found", "turns"}
            # Every model turn but a truncated last one ends with <|im_end|>, and env segments follow it.
            edges = np.flatnonzero(np.diff(s.loss_mask.astype(int)) == -1)  # last model token before env tokens
            # A turn ends at <|im_end|>, or at <|endoftext|> (also an eos of the tiny model) followed by an
            # env-side <|im_end|> so the conversation stays well-formed.
            for i in edges:
                assert s.completion_ids[i] == end or (s.completion_ids[i] == pad and s.completion_ids[i + 1] == end), \
                    tok.decode(s.completion_ids[i - 3: i + 3])
            assert len(edges) == s.turns - 1
            if s.turns > 1:
                multi_turn += 1
                env_text = tok.decode(s.completion_ids[~s.loss_mask])
                assert "<|im_start|>user\n" in env_text and env_text.endswith("<|im_start|>assistant\n")
            # The logprobs are the served model's, token by token (temperature 1).
            ids = torch.tensor(np.concatenate([s.prompt_ids, s.completion_ids]).astype(np.int64))[None]
            with torch.no_grad():
                logits = model(ids).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].numpy()[len(s.prompt_ids) - 1:]
            np.testing.assert_allclose(s.completion_logprobs[s.loss_mask], lp[s.loss_mask], atol=2e-3)
    assert multi_turn > 0, "no episode went past one turn; the test saw no env tokens"


def test_kill_9_mid_group_is_redone_exactly_once(stack):
    """Two workers share the tasks; one is killed mid-group; every group is published exactly once.

    Steps take 1.5 s, longer than claim_idle_ms, so this also checks that a live worker keeps its
    running tasks from being claimed by the other."""
    name = f"slow{uuid.uuid4().hex[:4]}"
    env = {"id": "tests.workers.stages.rollout_envs:slow_echo", "name": name, "group_size": 2, "args": {"step_s": 1.5}}
    config = stack.config([env], claim_idle_ms=800)
    workers = {c: stack.spawn("rollout", config, "--consumer", c) for c in ("ra", "rb")}
    stream = stack.keys.tasks(name)

    def consumers() -> dict[str, int]:
        try:
            return {c["name"].decode(): c["pending"] for c in stack.redis.xinfo_consumers(stream, GROUP_ROLLOUT)}
        except redis.ResponseError:
            return {}

    log_of = {c: stack.tmp / f"rollout-{len(stack.procs) - 2 + i}.log" for i, c in enumerate(("ra", "rb"))}
    logs = list(log_of.values())
    _wait_for(lambda: all("rollout_ready" in log.read_text() for log in logs), 120, "both rollout workers to start")
    stack.publish([_task(name, i, 2) for i in range(4)])
    _wait_for(lambda: any(consumers().values()), 30, "a worker to take a task")
    victim = next(c for c, pending in consumers().items() if pending)
    os.kill(workers[victim].pid, signal.SIGKILL)
    workers[victim].wait()
    assert not stack.groups(name) or len(stack.groups(name)) < 4

    _wait_for(lambda: len(stack.groups(name)) >= 4, 90, "all four groups")
    time.sleep(2.5)  # anything published twice would show up by now
    groups = stack.groups(name)
    assert sorted(g.task_id for g in groups) == sorted(f"{name}:0:{i}" for i in range(4))
    assert stack.redis.xpending(stream, GROUP_ROLLOUT)["pending"] == 0
    assert not [d for d in stack.dead() if d.stream == stream]
    survivor = "rb" if victim == "ra" else "ra"
    workers[survivor].send_signal(signal.SIGTERM)
    assert workers[survivor].wait(30) == 0
    reclaimed = [line for line in log_of[survivor].read_text().splitlines() if " task_reclaimed " in line]
    assert reclaimed and all(f"stream={stream} " in line and "deliveries=2" in line for line in reclaimed), reclaimed


async def test_a_rollout_past_its_timeout_is_retried_then_dead_lettered(stack):
    name = f"late{uuid.uuid4().hex[:4]}"
    env = {"id": "tests.workers.stages.rollout_envs:slow_echo", "name": name, "group_size": 1, "max_retries": 1,
           "rollout_timeout_s": 0.5, "args": {"step_s": 1.5}}
    config = load_config([stack.config([env])], [])
    before = int(stack.redis.hget(stack.keys.state(), INFLIGHT_FIELD) or 0)
    stack.publish([_task(name, 0, 1)], inflight=1)

    def mine():
        return [d for d in stack.dead() if d.stream == stack.keys.tasks(name)]

    worker = RolloutWorker(config, worker="r-timeout")
    with capture_logs() as logs:
        await worker.setup()
        running = asyncio.create_task(worker.run())
        deadline = time.monotonic() + 60
        while not mine() and time.monotonic() < deadline and not running.done():
            await asyncio.sleep(0.1)
        worker.request_stop()
        await running
        await worker.close()
    (letter,) = mine()
    assert "rollout_timeout_s=0.5" in letter.reason and "after 2 attempts" in letter.reason
    (logged,) = [e for e in logs if e["event"] == "task_dead_lettered"]  # what an operator greps for
    assert (logged["task_id"], logged["env"], logged["reason"]) == (f"{name}:0:0", name, letter.reason)
    assert stack.groups(name) == [] and int(stack.redis.hget(stack.keys.state(), INFLIGHT_FIELD)) == before


async def _proxy(port: int, target: str) -> web.AppRunner:
    """An HTTP proxy on ``port`` to ``target`` (the inference server coming back, as far as a client can tell)."""
    async def forward(request: web.Request) -> web.Response:
        async with aiohttp.ClientSession() as http, http.request(request.method, target + request.path,
                                                                data=await request.read(),
                                                                headers={"Content-Type": "application/json"}) as r:
            return web.Response(status=r.status, body=await r.read(), content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def test_tasks_taken_while_no_inference_server_answers_wait_for_one(stack):
    """No server answers on inference.base_urls for 4 s (connection refused), then one does: the tasks taken
    meanwhile are held (inference_unreachable) and then rolled out; with env.max_retries = 0 each used to become a
    dead letter at its first refused connection. The slow test below does the same with a 45 s outage."""
    name = f"hold{uuid.uuid4().hex[:4]}"
    env = {"id": "tests.workers.stages.rollout_envs:slow_echo", "name": name, "group_size": 2, "max_retries": 0,
           "args": {"step_s": 0.01}}
    port = free_port()
    config = load_config([stack.config([env])], [("inference.base_urls", [f"http://127.0.0.1:{port}/v1"])])
    stack.publish([_task(name, i, 2) for i in range(2)], inflight=4)

    with capture_logs() as logs:
        worker = RolloutWorker(config, worker="r-hold")
        await worker.setup()
        running = asyncio.create_task(worker.run())
        await asyncio.sleep(4)
        assert not [d for d in stack.dead() if d.stream == stack.keys.tasks(name)]  # held, not dead
        proxy = await _proxy(port, f"http://127.0.0.1:{stack.port}")
        deadline = time.monotonic() + 60
        while len(stack.groups(name)) < 2 and time.monotonic() < deadline and not running.done():
            await asyncio.sleep(0.1)
        worker.request_stop()
        await running
        await worker.close()
        await proxy.cleanup()
    assert sorted(g.task_id for g in stack.groups(name)) == [f"{name}:0:{i}" for i in range(2)]
    assert not [d for d in stack.dead() if d.stream == stack.keys.tasks(name)]
    assert any(e["event"] == "inference_unreachable" for e in logs)
    assert all(g.timings["inference_wait_s"] > 3 for g in stack.groups(name))


def _wait_healthy(stack: Stack, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{stack.port}/health", timeout=2)
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError("the inference server did not come up") from None
            time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(220)  # 73 s measured alone on the 2-core box
def test_an_inference_outage_holds_its_tasks_instead_of_dead_lettering_them(tmp_path, redis_server, tiny_model_dir):
    """The only inference server (reached through inference.base_urls, as an external vLLM would be) goes away for
    45 s, then comes back on the same port: every task, those running and those taken meanwhile, is held (claimed,
    retried with backoff, ``inference_unreachable`` logged) and published once; none is dead-lettered. Before, each
    became a dead letter after its env.max_retries tries (~1 s here)."""
    s = Stack(tmp_path, redis_server, tiny_model_dir)
    try:
        name = f"out{uuid.uuid4().hex[:4]}"
        env = {"id": "tests.workers.stages.rollout_envs:slow_echo", "name": name, "group_size": 2, "max_retries": 1,
               "args": {"step_s": 0.05}}
        config = s.config([env])
        server = s.spawn("inference", config, "--server-id", "s0")
        _wait_healthy(s, server, 180)
        worker = s.spawn("rollout", config, "--consumer", "r-outage")
        s.publish([_task(name, i, 2) for i in range(4)], inflight=8)
        _wait_for(lambda: len(s.groups(name)) >= 1, 120, "a first group")
        server.terminate()
        server.wait(30)
        s.publish([_task(name, i, 2) for i in range(4, 8)], inflight=8)
        time.sleep(45)
        assert s.dead() == [] and worker.poll() is None
        server = s.spawn("inference", config, "--server-id", "s0")
        _wait_healthy(s, server, 180)
        _wait_for(lambda: len(s.groups(name)) >= 8, 120, "all eight groups after the outage")
        time.sleep(1.0)
        assert sorted(g.task_id for g in s.groups(name)) == sorted(f"{name}:0:{i}" for i in range(8))
        assert s.dead() == [] and s.redis.xpending(s.keys.tasks(name), GROUP_ROLLOUT)["pending"] == 0
        log = (s.tmp / "rollout-1.log").read_text()
        assert "inference_unreachable" in log and "inference_recovered" in log
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
    finally:
        s.close()


async def _roll_through(stack: Stack, config, name: str, tasks: int, outage) -> list[dict]:
    """A rollout worker on ``tasks`` tasks of env ``name`` while ``outage(worker)`` takes its env server away and
    brings it back; the log events."""
    stack.publish([_task(name, i, 1) for i in range(tasks)], inflight=tasks)
    with capture_logs() as logs:
        worker = RolloutWorker(config, worker=f"r-{name}")
        await worker.setup()
        running = asyncio.create_task(worker.run())
        try:
            await outage(worker)
            deadline = time.monotonic() + 60
            while len(stack.groups(name)) < tasks and time.monotonic() < deadline and not running.done():
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)  # no second copy of a group
        finally:
            worker.request_stop()
            await running
            await worker.close()
    return logs


def _assert_held(stack: Stack, name: str, tasks: int, logs: list[dict], held_s: float) -> None:
    assert not [d for d in stack.dead() if d.stream == stack.keys.tasks(name)]
    assert sorted(g.task_id for g in stack.groups(name)) == [f"{name}:0:{i}" for i in range(tasks)]
    events = [e["event"] for e in logs]
    assert "env_unreachable" in events and "env_recovered" in events
    assert max(g.timings["env_wait_s"] for g in stack.groups(name)) > held_s


async def test_tasks_held_while_an_env_server_at_its_address_is_down(stack, tmp_path):
    """The env server at an [[env]]'s ``address`` is killed and started again on the same port 4 s later: the tasks
    taken meanwhile are held (``env_unreachable``), not dead-lettered, and each is published once when it is back.
    Before, with env.max_retries = 0, each became a dead letter at its first RpcTimeoutError."""
    name = f"ext{uuid.uuid4().hex[:4]}"
    address = f"tcp://127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "workers.cli", "env", "--id", "tests.workers.stages.rollout_envs:slow_echo",
            "--name", name, "--args", '{"step_s": 0.01}', "--bind", address]

    def serve() -> subprocess.Popen:
        with open(tmp_path / "env.log", "a") as log:  # the child writes to its own copy
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        stack.procs.append(proc)
        return proc

    server = serve()
    async with RpcClient(address, timeout_s=30) as client:
        await client.call("info")  # up before the worker connects
    env = {"id": "tests.workers.stages.rollout_envs:slow_echo", "name": name, "group_size": 1, "max_retries": 0,
           "address": address}
    config = load_config([stack.config([env], env_timeout_s=1.0)], [])

    async def outage(worker):
        server.kill()
        server.wait()
        await asyncio.sleep(4)
        assert not [d for d in stack.dead() if d.stream == stack.keys.tasks(name)]  # held, not dead
        serve()

    logs = await _roll_through(stack, config, name, 4, outage)
    _assert_held(stack, name, 4, logs, held_s=3)


async def test_tasks_held_while_a_spawned_env_server_cannot_restart(stack, tmp_path):
    """A spawned env server is killed and cannot start again for 3 s (its env refuses to load): the tasks wait for
    it (``env_unreachable``), not dead-lettered, each published once after it restarts. Before, with env.max_retries
    = 0, the failed restart made each task a dead letter."""
    name = f"spw{uuid.uuid4().hex[:4]}"
    flag = tmp_path / "down"
    env = {"id": "tests.workers.stages.rollout_envs:unstartable_while", "name": name, "group_size": 1,
           "max_retries": 0, "args": {"flag": str(flag)}}
    config = load_config([stack.config([env], env_timeout_s=5.0)], [])

    async def outage(worker):
        handle = worker.handles[name]
        flag.touch()
        os.kill(handle.pid, signal.SIGKILL)
        await asyncio.sleep(3)
        assert not [d for d in stack.dead() if d.stream == stack.keys.tasks(name)]  # held, not dead
        flag.unlink()

    logs = await _roll_through(stack, config, name, 4, outage)
    _assert_held(stack, name, 4, logs, held_s=1)
    assert worker_restarts(logs) >= 2  # the failed restart and the one that worked


def worker_restarts(logs: list[dict]) -> int:
    return sum(e["event"] == "env_server_restarted" for e in logs)
