"""Redis clients from a URL: redis-py's own (``redis://``, ``rediss://``, ``unix://``) or a primary found through
Sentinel::

    redis+sentinel://HOST:PORT[,HOST:PORT...]/PRIMARY[/DB]

The hosts are the sentinels, ``PRIMARY`` the name they monitor (``sentinel monitor PRIMARY …``), ``DB`` the
database (default 0). The primary's password comes from ``redis.password_var`` (the sentinels are asked without
one). A client of a primary found through Sentinel asks the sentinels again whenever a connection to it fails or
finds a replica, so after a failover the next retry (``redis.reconnect_timeout_s``) reaches the promoted one.
Every worker, tool and lease keeper connects through here, so any of them takes either form.
"""

import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelManagedConnection as AsyncSentinelConnection
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelManagedConnection

from bus.config import redact
from bus.errors import ConfigError

SENTINEL_SCHEME = "redis+sentinel"


@dataclass(frozen=True)
class SentinelAddress:
    """Where a ``redis+sentinel://`` URL says the primary is found."""

    sentinels: list[tuple[str, int]]
    primary: str
    db: int


def parse_sentinel_url(url: str) -> SentinelAddress:
    """The sentinels, primary name and db of a ``redis+sentinel://`` URL; ConfigError naming the fix otherwise."""
    form = f"{SENTINEL_SCHEME}://HOST:PORT[,HOST:PORT...]/PRIMARY[/DB]"
    parts, shown = urlsplit(url), redact(url)
    if parts.query:
        raise ConfigError(f"redis.url={shown!r}: a Sentinel URL takes no options (TLS to a Sentinel-managed primary is "
                          f"not supported); remove ?{urlsplit(shown).query}")
    if "@" in parts.netloc:
        raise ConfigError(f"redis.url={shown!r}: a Sentinel URL carries no password; set redis.password_var instead")
    sentinels = []
    for address in filter(None, parts.netloc.split(",")):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"redis.url={shown!r}: sentinel {address!r} is not HOST:PORT; write {form}")
        sentinels.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not sentinels or not 1 <= len(path) <= 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ConfigError(f"redis.url={shown!r} is not a Sentinel URL; write {form}")
    return SentinelAddress(sentinels, path[0], int(path[1]) if len(path) == 2 else 0)


def is_sentinel_url(url: str) -> bool:
    return url.startswith(f"{SENTINEL_SCHEME}://")


class _AsyncPrimaryConnection(AsyncSentinelConnection):
    """Asks the sentinels for the primary on every socket connect. redis-py's own reconnects a dropped connection
    (``send_packed_command`` → ``connect_check_health``) to the address it had, so after a failover a client kept
    talking to the old primary's port, and once that server was back, empty, wrote the run into it."""

    async def _connect(self):
        self.host, self.port = await self.connection_pool.get_master_address()
        await super()._connect()


class _AsyncSentinels(AsyncSentinel):
    """redis-py's, but connections opened at once keep every sentinel. Its ``discover_master`` moves the sentinel
    that answered to the front by the index it had before the await: concurrent discoveries past a dead first
    sentinel swapped by stale indexes and left the list holding one sentinel twice and losing another (no later
    failover found through it, its connections never closed)."""

    async def discover_master(self, service_name: str):
        errors = []
        for sentinel in list(self.sentinels):
            try:
                masters = await sentinel.sentinel_masters()
            except (redis_errors.ConnectionError, redis_errors.ResponseError, redis_errors.TimeoutError) as e:
                address = sentinel.connection_pool.connection_kwargs
                errors.append(f"{address.get('host')}:{address.get('port')}: {type(e).__name__}: {e}")
                continue
            state = masters.get(service_name)
            if state and self.check_master_state(state, service_name):
                at = self.sentinels.index(sentinel)  # where it is now, after the others' swaps
                self.sentinels[0], self.sentinels[at] = sentinel, self.sentinels[0]
                ip = state["ip"] if self._force_master_ip is None else self._force_master_ip
                return ip, state["port"]
        raise MasterNotFoundError(f"no sentinel names a healthy primary {service_name!r}: "
                                  f"{'; '.join(errors) or 'those that answered see it down or do not monitor it'}")


class _Sentinels(Sentinel):
    """redis-py's, asking one thread at a time: threads discovering at once lost sentinels as in
    :class:`_AsyncSentinels`."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._discovering = threading.Lock()

    def discover_master(self, service_name: str):
        with self._discovering:
            return super().discover_master(service_name)


class _PrimaryConnection(SentinelManagedConnection):
    """:class:`_AsyncPrimaryConnection` for blocking clients."""

    def _connect(self):
        self.host, self.port = self.connection_pool.get_master_address()
        return super()._connect()


def async_client(url: str, **options: Any) -> aioredis.Redis:
    """An asyncio client of ``url`` (``options`` as for ``redis.asyncio.Redis``)."""
    return _client(url, options, aioredis.Redis, _AsyncSentinels, _AsyncPrimaryConnection)


async def close_async_client(client: aioredis.Redis) -> None:
    """Close an :func:`async_client` and, for a primary found through Sentinel, its connections to the sentinels."""
    manager = getattr(client.connection_pool, "sentinel_manager", None)
    await client.aclose()
    for sentinel in manager.sentinels if manager is not None else ():
        await sentinel.aclose()


def sync_client(url: str, **options: Any) -> redis.Redis:
    """A blocking client of ``url`` (``options`` as for ``redis.Redis``)."""
    return _client(url, options, redis.Redis, _Sentinels, _PrimaryConnection)


def close_sync_client(client: redis.Redis) -> None:
    """:func:`close_async_client` for a :func:`sync_client`."""
    manager = getattr(client.connection_pool, "sentinel_manager", None)
    client.close()
    for sentinel in manager.sentinels if manager is not None else ():
        sentinel.close()


def _client(url: str, options: dict[str, Any], redis_class: type, sentinel_class: type, connection_class: type):
    if not is_sentinel_url(url):
        return redis_class.from_url(url, **options)
    address = parse_sentinel_url(url)
    # The timeout is the sentinels' own: given as connection kwargs, redis-py also put it on the primary's
    # connections, where a blocking read plus a WAIT (one replicated read) outlasted it and was retried without end.
    sentinel = sentinel_class(address.sentinels,
                              sentinel_kwargs={"socket_timeout": options.get("socket_timeout") or 2.0})
    return sentinel.master_for(address.primary, redis_class=redis_class, db=address.db,
                               connection_class=connection_class, **options)
