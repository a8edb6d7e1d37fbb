"""The private redis-server: the install hint, start and stop."""

import pytest
import redis

from bus.errors import RedisNotInstalledError
from bus.local_redis import LocalRedis


def test_local_redis_without_binary_says_how_to_install(monkeypatch):
    monkeypatch.setattr("bus.local_redis.shutil.which", lambda name: None)
    with pytest.raises(RedisNotInstalledError, match="apt-get install -y redis-server"):
        LocalRedis().start()


def test_local_redis_starts_and_stops(tmp_path):
    with LocalRedis(dir=tmp_path) as server:
        url = server.url
        client = redis.Redis.from_url(url)
        assert client.ping()
        assert client.config_get("appendonly")["appendonly"] == "yes"
        client.close()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
