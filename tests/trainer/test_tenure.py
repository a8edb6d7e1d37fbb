"""One trainer at a time: a standby takes over when the holder dies, a replaced or rolled-back holder publishes
nothing, and a checkpoint newer than Redis stops the run (real redis-server, real trainer processes)."""

import asyncio
import os
import subprocess
import sys
import time

import pytest
import redis
from structlog.testing import capture_logs

from bus.config import RedisConfig
from bus.errors import ConfigError, RlbusError
from bus.keys import Keys
from bus.lease import LeaseLost
from bus.local_redis import LocalRedis
from bus.messages import PolicyVersion
from bus.state import TRAINER_FIELD
from bus.streams import Bus
from tests.outages import redis_outage
from tests.paths import REPO
from tests.trainer.helpers import save_tiny_model, step_batches
from tests.trainer.test_worker import make_config, publish_steps, stream, train
from trainer.dist import DistContext
from trainer.tenure import TrainerTenure
from workers.run.resolved import dump_toml


def start_trainer(cfg_file, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "workers.cli", "trainer", "@", str(cfg_file)], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=log, stderr=subprocess.STDOUT)


def wait_field(redis_client, run_name, suffix: str, timeout_s: float = 90) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = redis_client.hget(Keys(run_name).state(), TRAINER_FIELD)
        if value is not None and value.decode().endswith(suffix):
            return value.decode()
        time.sleep(0.1)
    raise AssertionError(f"{TRAINER_FIELD} never ended in {suffix!r} (now {value!r})")


async def test_a_second_trainer_waits_as_a_standby_and_takes_over_when_the_first_dies(tmp_path, redis_url,
                                                                                      bus, run_name,
                                                                                      redis_client):
    model_dir = save_tiny_model(tmp_path / "model")
    await publish_steps(bus, range(1, 3))
    cfg = make_config(redis_url, run_name, tmp_path / "out", model_dir, trainer={"lease_ttl_s": 1.0},
                      ckpt={"resume_step": -1})  # as in rlbus run's config.resolved.toml
    cfg_file = tmp_path / "trainer.toml"
    cfg_file.write_text(dump_toml(cfg.model_dump(mode="json")))
    with open(tmp_path / "first.log", "w") as first_log, open(tmp_path / "second.log", "w") as second_log:
        first = start_trainer(cfg_file, first_log)
        holder = wait_field(redis_client, run_name, "@2").rpartition("@")[0]  # trained steps 1–2, waits for 3
        second = start_trainer(cfg_file, second_log)
        time.sleep(4)
        assert second.poll() is None and wait_field(redis_client, run_name, "@2") == f"{holder}@2"  # a standby
        first.kill()
        first.wait()
        await publish_steps(bus, range(3, 5))
        assert second.wait(timeout=90) == 0, (tmp_path / "second.log").read_text()[-3000:]
    taken = redis_client.hget(Keys(run_name).state(), TRAINER_FIELD).decode()
    assert taken.endswith("@4") and not taken.startswith(holder)
    versions = await stream(bus, lambda k: k.policy())
    assert [p.step for p in versions if isinstance(p, PolicyVersion)] == [0, 1, 2, 2, 3, 4]  # step 2 re-published
    assert not redis_client.exists(Keys(run_name).lease("trainer"))  # a clean stop hands the lease over at once


async def test_a_stalled_holder_that_was_replaced_publishes_nothing(redis_url, bus, run_name):
    config = make_config(redis_url, run_name, "/tmp/unused", "/tmp/unused", trainer={"lease_ttl_s": 0.3})
    trained = PolicyVersion(role="trained", step=1)

    async with bus("a") as a, bus("b") as b:
        stop = asyncio.Event()
        first = TrainerTenure(a, config, DistContext())
        assert await first.acquire(stop)
        await first.claim(0)
        await first.publish([(a.keys.policy(), trained)], step=1)
        first.keeper.close()  # it stalls: no more renewals
        second = TrainerTenure(b, config, DistContext())
        second.holder = second.lease.holder = "standby:1"
        assert await asyncio.wait_for(second.acquire(stop), 5)
        await second.claim(1)
        with pytest.raises(LeaseLost, match="standby:1 took over"):
            await first.publish([(a.keys.policy(), PolicyVersion(role="trained", step=2))], step=2)
        versions = [m.step for _, m in await a.read_fanout(a.keys.policy(), "0")]
        assert versions == [1]
        await b.state_set(**{TRAINER_FIELD: "standby:1@0"})  # Redis went back (an older copy of the run)
        with pytest.raises(RlbusError, match="went back from step 1 to 0"):
            await second.publish([(b.keys.policy(), trained)], step=2)
        await second.close()


async def test_a_checkpoint_newer_than_the_redis_it_resumes_onto_stops_the_run(tmp_path, redis_url, bus,
                                                                               run_name, redis_client):
    model_dir = save_tiny_model(tmp_path / "model")
    await publish_steps(bus, range(1, 5))
    await train(make_config(redis_url, run_name, tmp_path / "a", model_dir, run={"max_steps": 2}))
    keys = list(redis_client.scan_iter(match=f"{Keys(run_name).prefix}*"))
    older = {key: redis_client.dump(key) for key in keys}  # a snapshot of Redis at step 2
    await train(make_config(redis_url, run_name, tmp_path / "a", model_dir, ckpt={"resume_step": -1}))
    for key in redis_client.scan_iter(match=f"{Keys(run_name).prefix}*"):  # Redis goes back to the snapshot
        redis_client.delete(key)
    for key, dumped in older.items():
        redis_client.restore(key, 0, dumped)
    with pytest.raises(ConfigError, match="last published step 2, but checkpoint step_4 is newer"):
        await train(make_config(redis_url, run_name, tmp_path / "a", model_dir, ckpt={"resume_step": -1}))
    # resuming from a checkpoint Redis is not behind (step 2) is the documented way on
    await train(make_config(redis_url, run_name, tmp_path / "a", model_dir, ckpt={"resume_step": 2},
                            run={"max_steps": 3}))
    assert redis_client.hget(Keys(run_name).state(), TRAINER_FIELD).decode().endswith("@3")


async def test_a_trainer_rides_out_a_redis_outage_longer_than_its_lease(tmp_path, run_name):
    """Redis away for four lease TTLs (within redis.reconnect_timeout_s) between two steps: the trainer keeps its
    lease and trains on once Redis is back, instead of stopping after one TTL."""
    server = LocalRedis(dir=tmp_path / "redis")
    url = server.start()
    model_dir = save_tiny_model(tmp_path / "model")
    client = redis.Redis.from_url(url)

    async def publish(steps):
        b = await Bus.connect(url, run_name, RedisConfig(url=url), "packer")
        for step in steps:
            await b.publish_many(b.keys.batches(step), step_batches(step, 2))
        await b.close()

    await publish(range(1, 3))
    cfg_file = tmp_path / "trainer.toml"
    cfg_file.write_text(dump_toml(make_config(url, run_name, tmp_path / "out", model_dir,
                                              trainer={"lease_ttl_s": 1.0}).model_dump(mode="json")))
    try:
        with open(tmp_path / "trainer.log", "w") as log:
            trainer = start_trainer(cfg_file, log)
            wait_field(client, run_name, "@2")  # trained steps 1–2, waits for 3
            server = redis_outage(server, tmp_path / "redis", 4.0)
            await publish(range(3, 5))
            assert trainer.wait(timeout=90) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        assert client.hget(Keys(run_name).state(), TRAINER_FIELD).decode().endswith("@4")
    finally:
        if trainer.poll() is None:
            trainer.kill()
        client.close()
        server.stop()


async def test_a_wedged_holder_lets_its_lease_go_and_a_standby_takes_over(redis_url, bus, run_name):
    """A trainer whose loop makes no progress (a hung collective, stuck storage) stops renewing its lease once
    trainer.progress_timeout_s passes: a standby takes over, and the wedged one, awake again, publishes nothing."""
    config = make_config(redis_url, run_name, "/tmp/unused", "/tmp/unused",
                         trainer={"lease_ttl_s": 0.3, "progress_timeout_s": 0.5})
    stop = asyncio.Event()
    async with bus("a") as a, bus("b") as b:
        wedged = TrainerTenure(a, config, DistContext())
        assert await wedged.acquire(stop)
        await wedged.claim(0)
        standby = TrainerTenure(b, config, DistContext())
        with capture_logs() as logs:
            assert await asyncio.wait_for(standby.acquire(stop), 5)  # no check() from the wedged one meanwhile
        lapsing = [e for e in logs if e["event"] == "lease_lapsing"]  # what an operator greps for: the wedged one's
        assert lapsing and lapsing[0]["key"] == wedged.lease.key and lapsing[0]["idle_s"] >= 0.5  # progress_timeout_s
        await standby.claim(0)
        with pytest.raises(LeaseLost, match="took over"):
            await wedged.publish([(a.keys.policy(), PolicyVersion(role="trained", step=1))], step=1)
        await standby.close()
        wedged.keeper.close()


async def test_a_holder_that_makes_progress_keeps_its_lease(redis_url, bus, run_name):
    config = make_config(redis_url, run_name, "/tmp/unused", "/tmp/unused",
                         trainer={"lease_ttl_s": 0.3, "progress_timeout_s": 0.5})
    stop = asyncio.Event()
    async with bus("a") as a, bus("b") as b:
        working = TrainerTenure(a, config, DistContext())
        assert await working.acquire(stop)
        standby = asyncio.create_task(TrainerTenure(b, config, DistContext()).acquire(stop))
        for _ in range(15):  # 1.5 s of steps, each well within the bound
            working.check()
            await asyncio.sleep(0.1)
        assert not standby.done()
        stop.set()
        assert not await standby
        await working.close()
