"""Redis behind Sentinel: ``redis+sentinel://`` URLs, commits that wait for a replica, and a failover under a live
bus (the primary killed -9, the replica promoted, the same Bus carries on against it)."""

import asyncio

import pytest

from bus.clients import parse_sentinel_url
from bus.config import RedisConfig
from bus.errors import ConfigError
from bus.messages import Metric, Task
from bus.streams import Bus
from tests.sentinels import SentinelCluster


def test_a_sentinel_url_names_the_sentinels_the_primary_and_the_db():
    address = parse_sentinel_url("redis+sentinel://10.0.0.1:26379,10.0.0.2:26380/rlbus/3")
    assert address.sentinels == [("10.0.0.1", 26379), ("10.0.0.2", 26380)]
    assert (address.primary, address.db) == ("rlbus", 3)
    assert parse_sentinel_url("redis+sentinel://h:1/p").db == 0


@pytest.mark.parametrize("url, why", [
    ("redis+sentinel://h:1", "is not a Sentinel URL"),
    ("redis+sentinel://h/p", "is not HOST:PORT"),
    ("redis+sentinel://:pw@h:1/p", "redis.password_var"),
    ("redis+sentinel://h:1/p/x", "is not a Sentinel URL"),
])
def test_a_bad_sentinel_url_says_the_form(url, why):
    with pytest.raises(ConfigError, match=why):
        parse_sentinel_url(url)


@pytest.fixture
def cluster(tmp_path):
    cluster = SentinelCluster(tmp_path).start()
    yield cluster
    cluster.stop()


@pytest.mark.timeout(120)
def test_a_bus_follows_a_failover_and_keeps_what_it_committed(cluster, run_name):
    cfg = RedisConfig(url=cluster.url, wait_replicas=1, reconnect_timeout_s=30)

    async def main():
        bus = await Bus.connect(cluster.url, run_name, cfg, "w1")
        tasks, out = bus.keys.tasks("e"), bus.keys.metrics()
        await bus.ensure_group(tasks, "g")
        await bus.publish(tasks, Task(task_id="e:0:0", env="e", example_index=0, example_id="0", group_size=1))
        entries = await bus.read_group([tasks], "g", count=1)
        await bus.commit([(tasks, "g", entries[0].id)], [(out, Metric(source="t", values={"n": 1.0}))])
        assert cluster.primary() == "a"
        await asyncio.to_thread(cluster.kill, "a")  # the commit waited for the replica: it is there
        await bus.publish(out, Metric(source="t", values={"n": 2.0}))  # retried until the replica is promoted
        assert cluster.primary() == "b"
        assert await bus.redis.xlen(out) == 2
        assert (await bus.redis.xpending(tasks, "g"))["pending"] == 0  # the ack made it too
        await bus.close()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_blocked_readers_follow_the_failover_and_never_write_into_the_old_primary_come_back_empty(cluster, run_name):
    """redis-py alone reconnects a dropped connection to the address it had: once the killed primary is back
    (empty, before the sentinels make it a replica), its readers got NOGROUP from it and its writers wrote there."""
    cfg = RedisConfig(url=cluster.url, reconnect_timeout_s=30)

    async def main():
        bus = await Bus.connect(cluster.url, run_name, cfg, "w1")
        stream = bus.keys.tasks("e")
        await bus.ensure_group(stream, "g")
        failing_over = asyncio.create_task(asyncio.to_thread(cluster.fail_over))
        ports = set()
        while not failing_over.done():  # four readers blocked in XREADGROUP when the primary dies, and after
            await asyncio.gather(*(bus.redis.xreadgroup("g", f"c{i}", {stream: ">"}, count=1, block=300)
                                   for i in range(4)))
            ports.add((await bus.redis.info("server"))["tcp_port"])
        assert await failing_over == "b"
        for _ in range(10):
            await asyncio.gather(*(bus.redis.xreadgroup("g", f"c{i}", {stream: ">"}, count=1, block=100)
                                   for i in range(4)))
        assert (await bus.redis.info("server"))["tcp_port"] == cluster.ports["b"]
        assert ports <= {cluster.ports["a"], cluster.ports["b"]}
        await bus.close()

    asyncio.run(main())
