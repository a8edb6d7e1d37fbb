"""The config sections the bus itself needs: the ``Section`` base, ``[redis]`` and ``[log]``.

The bus owns these (as arq keeps ``RedisSettings`` beside ``create_pool``), so ``bus/`` imports
nothing above it; ``workers.config.RlbusConfig`` composes them with every other section.
"""

import os
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_serializer

from bus.errors import ConfigError


def split_password(url: str) -> tuple[str, str | None]:
    """``url`` without its password (in the user part or a ``?password=`` option), and that password decoded from
    its percent-encoding as redis-py reads it (None when it has none)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    password = next((value for name, value in query if name == "password"), None)
    if parts.password is not None:
        password = unquote(parts.password)
        user = parts.username or ""
        host = parts.hostname or ""
        netloc = f"{user}@{host}" if user else host
        if parts.port is not None:
            netloc += f":{parts.port}"
        parts = parts._replace(netloc=netloc)
    if password is None:
        return url, None
    kept = "&".join(item for item in parts.query.split("&") if item and item.split("=", 1)[0] != "password")
    return urlunsplit(parts._replace(query=kept)), password


def redis_password(cfg: "RedisConfig") -> str | None:
    """The password of ``cfg.password_var``, else the first line of ``cfg.password_file`` (None without either: the
    URL's own, if any, applies)."""
    if cfg.password_var is None and cfg.password_file is None:
        return None
    if cfg.password_var is None:
        try:
            return Path(cfg.password_file).read_text().splitlines()[0]
        except (OSError, IndexError) as e:
            raise ConfigError(f"redis.password_file={cfg.password_file!r} cannot be read ({e}); point it at the "
                              "file of the run's password (rlbus run writes OUTPUT_DIR/redis/password)") from e
    value = os.environ.get(cfg.password_var)
    if value is None:
        raise ConfigError(f"redis.password_var={cfg.password_var!r} is not set in the environment; export it")
    return value


def redact(url: str | None) -> str | None:
    """``url`` with its password (in the user part or a ``?password=`` option) shown as ``***``: what may be
    printed, logged or saved."""
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.password is not None:
        parts = parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1))
    query = "&".join("password=***" if item.split("=", 1)[0] == "password" else item
                     for item in parts.query.split("&")) if parts.query else parts.query
    return urlunsplit(parts._replace(query=query))


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, defaults are validated."""

    model_config = ConfigDict(extra="forbid", validate_default=True, populate_by_name=True,
                              use_attribute_docstrings=True)


class RedisConfig(Section):
    url: str | None = None
    """Redis URL (``redis://host:port/db``, or ``rediss://`` for TLS, with redis-py's query options such as
    ``?ssl_ca_certs=/path/ca.pem``), or ``redis+sentinel://HOST:PORT,HOST:PORT,…/PRIMARY[/DB]`` for the primary
    the sentinels monitor as ``PRIMARY`` (it follows a failover). None: ``rlbus run`` starts a private
    redis-server; other roles fail."""

    maxlen: int = Field(10_000, ge=1)
    """Approximate MAXLEN of ``metrics`` and ``dead`` (XADD ``MAXLEN ~``; ``rlbus run`` keeps every metrics row in
    metrics.jsonl). The consumer-group streams (tasks, rollouts, filtered) are trimmed behind their slowest group
    instead."""

    events_maxlen: int = Field(1_000, ge=10)
    """Approximate MAXLEN of ``policy`` and ``weights``: their readers need only the newest events (a server
    catches up from the newest weights; a tracker from the newest versions), so a long run keeps a flat footprint."""

    claim_idle_ms: int = Field(60_000, ge=100)
    """A pending entry idle this long (its consumer presumed dead) is reclaimed by another consumer."""

    block_ms: int = Field(1_000, ge=1)
    """XREADGROUP/XREAD BLOCK timeout: how long a worker's read waits for an entry before its loop goes round (a
    SIGTERM wakes a blocked read at once)."""

    max_deliveries: int = Field(5, ge=1)
    """An entry delivered this many times without an ack goes to ``dead``."""

    max_entry_bytes: int = Field(64 * 2**20, ge=1024)
    """Largest stream entry (field names and values together) a worker decodes. A bigger one is dead-lettered
    with its fields cut to their first KiB (a consumer-group stream) or skipped (a fan-out reader), so one
    oversized entry cannot exhaust a worker's memory while it is decoded. The default (64 MiB) is far above
    any real group or micro-batch."""

    wait_replicas: int = Field(0, ge=0)
    """Replicas every commit (a stage's outputs with its acks, a trained step, a weights event) waits for
    (Redis ``WAIT``) before the worker goes on, so a failover does not lose what the run already acted on as done.
    0: no waiting (a Redis without replicas)."""

    wait_timeout_ms: int = Field(1_000, ge=1)
    """How long a commit waits for ``wait_replicas``; past it the worker logs ``replication_lagging`` and goes on
    (the write is on the primary, not yet on enough replicas)."""

    password_var: str | None = None
    """Environment variable holding the Redis password (AUTH), so it stays out of URLs, files and logs;
    None = the URL's password, if any. Printed and saved configs show a URL password as ``***``."""

    password_file: str | None = None
    """File whose first line is the Redis password (used when ``password_var`` is not set). ``rlbus run`` writes
    one (mode 0600, ``OUTPUT_DIR/redis/password``) for the private redis-server it starts, with a fresh random
    password, and names it in ``config.resolved.toml``, so its children and ``rlbus inspect @
    OUTPUT_DIR/config.resolved.toml`` find it."""

    reconnect_timeout_s: float = Field(60.0, ge=0)
    """How long a Redis call keeps retrying while the server is unreachable (a restart, a blip, a failover),
    reconnecting with exponential backoff from 0.1 s up to 5 s between tries; past it the call fails and the
    worker exits for its supervisor to restart. 0: fail at once."""

    heartbeat_s: float = Field(5.0, gt=0)
    """How often every worker renews its heartbeat in ``workers`` (``rlbus health``, the containers' liveness
    probes); a worker is unhealthy once its heartbeat is six of these old."""

    @field_serializer("url")
    def _redacted(self, url: str | None) -> str | None:
        return redact(url)


class LogConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level."""

    json_lines: bool = Field(False, validation_alias=AliasChoices("json", "json_lines"))
    """Log JSON lines instead of the console format (``--log.json``)."""


