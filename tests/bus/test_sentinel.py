"""Redis behind Sentinel: ``redis+sentinel://`` URLs, commits that wait for a replica, and a failover under a live
bus (the primary killed -9, the replica promoted, the same Bus carries on against it)."""

import asyncio
import signal
import threading

import pytest
import redis

from bus.clients import close_sync_client, parse_sentinel_url, sync_client
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
async def test_a_bus_follows_a_failover_and_keeps_what_it_committed(cluster, run_name):
    cfg = RedisConfig(url=cluster.url, wait_replicas=1, reconnect_timeout_s=30)

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


@pytest.mark.timeout(120)
async def test_blocked_readers_follow_the_failover_and_never_write_into_the_old_primary_come_back_empty(cluster,
                                                                                                        run_name):
    """redis-py alone reconnects a dropped connection to the address it had: once the killed primary is back
    (empty, before the sentinels make it a replica), its readers got NOGROUP from it and its writers wrote there."""
    cfg = RedisConfig(url=cluster.url, reconnect_timeout_s=30)

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


@pytest.mark.timeout(120)
async def test_a_replicated_read_never_returns_an_entry_the_failover_takes_back(cluster, run_name):
    """A reader that keeps what it reads (``metrics.jsonl``) read a row the primary had not yet replicated, the
    primary died, and the promoted replica never had the row: the run's books counted a group twice. With
    ``replicated=True`` the read and its WAIT are one pipeline, retried whole on the promoted primary."""
    cfg = RedisConfig(url=cluster.url, wait_replicas=1, wait_timeout_ms=3_000, reconnect_timeout_s=30)

    bus = await Bus.connect(cluster.url, run_name, cfg, "reader")
    out = bus.keys.metrics()
    kept = await bus.publish(out, Metric(source="t", values={"n": 1.0}))
    replica = cluster.procs["b"]
    replica.send_signal(signal.SIGSTOP)  # the replica can neither read its link nor reconnect
    try:
        primary = cluster.client("a")
        primary.client_kill_filter(_type="replica")  # so nothing written from here on reaches it
        primary.xadd(out, Metric(source="t", values={"n": 2.0}).to_fields())
        reading = asyncio.create_task(bus.read_fanout(out, "0", count=10, replicated=True))
        await asyncio.sleep(1.0)
        assert not reading.done()  # waiting for the replica to hold what it read
        await asyncio.to_thread(cluster.kill, "a")
    finally:
        replica.send_signal(signal.SIGCONT)
    rows = await asyncio.wait_for(reading, 60)
    assert cluster.primary() == "b"
    assert [entry_id for entry_id, _ in rows] == [kept]
    await bus.close()


@pytest.mark.timeout(120)
async def test_connections_opened_at_once_past_a_dead_sentinel_keep_every_sentinel_for_the_next_failover(cluster,
                                                                                                       run_name):
    """redis-py moved the sentinel that answered to the front by the index it had before its await: connections
    opened at once, each skipping the dead first sentinel, swapped by stale indexes, and the client was left knowing
    one sentinel twice and the dead one not at all. Once that one was back and the others down, the primary was
    found through no one (and connections to a dropped live sentinel were never closed)."""
    bus = await Bus.connect(cluster.url, run_name, RedisConfig(url=cluster.url), "w1")
    await bus.redis.connection_pool.disconnect()
    cluster.kill("sentinel0")  # the one it asks first
    await asyncio.gather(*(bus.redis.execute_command("PING") for _ in range(8)))  # eight connects at once
    await asyncio.to_thread(only_the_dead_sentinel_left, cluster)
    await bus.redis.connection_pool.disconnect()
    assert await bus.redis.execute_command("PING")  # through sentinel0 alone
    await bus.close()
    assert_no_clients_on(cluster.sentinel_ports[0])


def test_threads_connecting_at_once_past_a_dead_sentinel_keep_every_sentinel(cluster):
    """The blocking client (the exporter's scrapes and its follower thread share one) raced the same way; closing it
    closes its sentinel connections too."""
    client = sync_client(cluster.url)
    client.connection_pool.disconnect()
    cluster.kill("sentinel0")
    start = threading.Barrier(8)
    threads = [threading.Thread(target=lambda: (start.wait(), client.ping())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    only_the_dead_sentinel_left(cluster)
    client.connection_pool.disconnect()
    assert client.ping()
    close_sync_client(client)
    assert_no_clients_on(cluster.sentinel_ports[0])


def only_the_dead_sentinel_left(cluster: SentinelCluster) -> None:
    cluster.start_sentinel(0)
    cluster.kill("sentinel1")
    cluster.kill("sentinel2")


def assert_no_clients_on(port: int) -> None:
    with redis.Redis(port=port, decode_responses=True) as sentinel:
        clients = [c for c in sentinel.client_list() if c["cmd"] != "client|list"]
    assert clients == [], f"the closed client left connections on the sentinel: {clients}"
