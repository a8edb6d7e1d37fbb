"""A commit is applied once even when its reply is lost and redis-py re-sends it (real redis-server behind a
proxy that drops one reply)."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import pytest

from bus.commit import COMMIT_LUA
from bus.config import RedisConfig
from bus.messages import Metric, Task
from bus.streams import Bus
from tests.lossy_proxy import LossyProxy

GROUP = "rollout"


def task(i: int) -> Task:
    return Task(task_id=f"e:0:{i}", env="e", example_index=i, example_id=str(i), group_size=2)


@asynccontextmanager
async def lossy_bus(redis_url: str, run: str, **overrides) -> AsyncIterator[tuple[Bus, LossyProxy]]:
    """A Bus whose connections pass through a :class:`LossyProxy`, with the commit script already loaded (a first
    EVALSHA answered NOSCRIPT would otherwise be the reply dropped)."""
    target = urlsplit(redis_url)
    proxy = LossyProxy(target.hostname, target.port)
    port = await proxy.start()
    url = f"redis://127.0.0.1:{port}/0"
    bus = await Bus.connect(url, run, RedisConfig(url=url, **overrides), "w1")
    await bus.redis.script_load(COMMIT_LUA)
    try:
        yield bus, proxy
    finally:
        await bus.close()
        await proxy.close()


async def test_a_commit_without_acks_whose_reply_was_lost_is_applied_once(redis_url, run_name):
    """As the feeder's and eval's issues: outputs and a counter, nothing acked; the re-send must not add them again."""
    async with lossy_bus(redis_url, run_name) as (b, proxy):
        stream, state = b.keys.tasks("e"), b.keys.state()
        proxy.drop_reply_of(b"EVALSHA")
        ids = await b.commit([], [(stream, task(i)) for i in range(4)],
                             extra=lambda commands: commands.hincrby(state, "issued", 4))
        assert proxy.dropped == 1
        assert [i.decode() for i, _ in await b.redis.xrange(stream)] == ids  # 4 tasks, not 8
        assert await b.state_get("issued") == "4"


async def test_a_guarded_commit_whose_reply_was_lost_is_not_refused_by_its_own_first_send(redis_url, run_name):
    """As the trainer's publish: guarded on the field it advances; the re-send finds the field advanced by itself."""
    async with lossy_bus(redis_url, run_name) as (b, proxy):
        state, policy = b.keys.state(), b.keys.policy()
        await b.state_set(trainer="me@1")
        proxy.drop_reply_of(b"EVALSHA")
        ids = await b.commit([], [(policy, Metric(source="trainer", values={}))], guard=(state, "trainer", "me@1"),
                             extra=lambda commands: commands.hset(state, "trainer", "me@2"))
        assert proxy.dropped == 1
        assert [i.decode() for i, _ in await b.redis.xrange(policy)] == ids
        assert await b.state_get("trainer") == "me@2"


@pytest.mark.parametrize("wait_replicas", [0, 1])
async def test_a_commit_with_acks_whose_reply_was_lost_succeeds_once(redis_url, run_name, wait_replicas):
    """A stage's commit: the re-send returns the first send's ids instead of NotOwned (also when the commit travels
    in a pipeline with its WAIT)."""
    async with lossy_bus(redis_url, run_name, wait_replicas=wait_replicas, wait_timeout_ms=1) as (b, proxy):
        stream, out = b.keys.tasks("e"), b.keys.rollouts("e")
        await b.publish(stream, task(0))
        (entry,) = await b.read_group([stream], GROUP)
        proxy.drop_reply_of(b"EVALSHA")
        ids = await b.commit([(stream, GROUP, entry.id)], [(out, Metric(source="w1", values={}))])
        assert proxy.dropped == 1
        assert [i.decode() for i, _ in await b.redis.xrange(out)] == ids and len(ids) == 1
        assert (await b.redis.xpending(stream, GROUP))["pending"] == 0
