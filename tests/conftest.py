"""Shared fixtures: one private redis-server per session, a run name per test, buses, a tiny model.

Tests that await are plain ``async def`` (pytest-asyncio in auto mode, one event loop per test); a Bus belongs
to the loop it was made in::

    async def test_x(bus):
        async with bus("w1", claim_idle_ms=100) as b:
            await b.publish(b.keys.metrics(), ...)
"""

import gc
import os
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, settings

from bus.config import RedisConfig
from bus.local_redis import LocalRedis
from bus.streams import Bus

# Timing-based hypothesis checks are meaningless on a shared 2-core box: keep the examples, drop the deadline.
settings.register_profile("rlbus", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("rlbus")

# Spawned workers share 2 cores with everyone else's tests.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """URL of a private redis-server (free port, AOF in a temp dir) for the whole session."""
    server = LocalRedis(dir=tmp_path_factory.mktemp("redis"))
    url = server.start()
    yield url
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server


@pytest.fixture
def run_name() -> str:
    """A run name no other test uses, so tests never see each other's streams."""
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def redis_client(redis_url):
    """A plain (sync) redis-py client, bytes in and out, for checking what landed in Redis."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def bus(redis_url, run_name):
    """Factory of Buses for this test's run: ``async with bus(worker, **redis_overrides) as b``."""

    @asynccontextmanager
    async def make(worker: str = "test", run: str | None = None, **overrides):
        cfg = RedisConfig(url=redis_url, **overrides)
        b = await Bus.connect(redis_url, run or run_name, cfg, worker)
        try:
            yield b
        finally:
            await b.close()

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random-init tiny Qwen3 with its byte-level tokenizer, built once per session."""
    from workers.tools.init_model import build_model

    return build_model(tmp_path_factory.mktemp("tiny-model"), preset="tiny", seed=0)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Collect garbage once a test module is done, so what its tests left unclosed (a socket, an event loop) warns,
    and with warnings as errors fails, in that module's last test, not in whichever later test the collector runs."""
    if nextitem is None or nextitem.module is not item.module:
        gc.collect()
