"""A rollout worker with adaptive concurrency against a real built-in inference server
(workers/stages/concurrency.py)."""

import asyncio
import time
import uuid

import aiohttp
from structlog.testing import capture_logs

from bus.local_redis import free_port
from bus.messages import Metric
from tests.workers.stages.test_rollout import _task, stack  # noqa: F401 (the module's server, reused)
from workers.config_loader import load_config
from workers.stages.rollout import RolloutWorker
from workers.stages.server_load import ServerLoad


async def test_adaptive_concurrency_grows_past_its_floor_while_the_server_has_room(stack):  # noqa: F811
    """Starting at one group, the worker adds a group each interval while the server's queue is empty and its batch
    has room (logged as rollout_concurrency, published as rollout/concurrency_limit)."""
    name = f"ad{uuid.uuid4().hex[:4]}"
    env = {"id": "echo_chars", "name": name, "group_size": 2, "args": {"num_examples": 200}}
    concurrency = {"adaptive": True, "floor": 1, "ceiling": 6, "interval_s": 0.2}
    config = load_config([stack.config([env], max_concurrent_groups=1, concurrency=concurrency)], [])
    stack.publish([_task(name, i, 2) for i in range(200)], inflight=400)
    with capture_logs() as logs:
        worker = RolloutWorker(config, worker=f"r-{name}")
        await worker.setup()
        running = asyncio.create_task(worker.run())
        deadline = time.monotonic() + 60
        while worker.concurrency.limit < 4 and time.monotonic() < deadline and not running.done():
            await asyncio.sleep(0.1)
        worker.request_stop()
        await running
        await worker.close()
    changes = [e for e in logs if e["event"] == "rollout_concurrency"]
    assert worker.concurrency.limit >= 4, changes
    limit = 1  # each growth adds one group to the limit it had (a cut between two, on a busy box, is allowed)
    for change in changes:
        assert change["reason"] != "headroom" or change["limit"] == limit + 1, changes
        limit = change["limit"]
    assert {2, 3, 4} <= {e["limit"] for e in changes if e["reason"] == "headroom"}, changes
    metrics = [Metric.from_fields(f) for _, f in stack.redis.xrange(stack.keys.metrics())]
    assert max(m.values.get("rollout/concurrency_limit", 0) for m in metrics) >= 2


async def test_the_load_of_the_builtin_server_and_of_one_that_does_not_answer(stack):  # noqa: F811
    """/health gives the queue, the batch-slot use and, between two polls with decoding, the latency per token; a
    server that does not answer is left out, and with none answering the poll is None (the limit holds)."""
    url = f"http://127.0.0.1:{stack.port}/v1"
    servers = ServerLoad([url, f"http://127.0.0.1:{free_port()}/v1"], {}, timeout_s=2.0)
    try:
        first = await servers.poll()
        assert first.waiting == 0 and first.use is not None and first.token_s is None
        async with aiohttp.ClientSession() as http:
            body = {"model": "m", "prompt": "abc", "max_tokens": 8, "n": 2}
            async with http.post(f"{url}/completions", json=body) as r:
                assert r.status == 200
        second = await servers.poll()
        assert second.token_s is not None and second.token_s > 0 and second.preemptions == 0
    finally:
        await servers.close()
    down = ServerLoad([f"http://127.0.0.1:{free_port()}/v1"], {}, timeout_s=1.0)
    try:
        assert await down.poll() is None
    finally:
        await down.close()
