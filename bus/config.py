"""The config sections the bus itself needs: the ``Section`` base, ``[redis]`` and ``[log]``.

The bus owns these (as arq keeps ``RedisSettings`` beside ``create_pool``), so ``bus/`` imports
nothing above it; ``workers.config.RlbusConfig`` composes them with every other section.
"""

from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, defaults are validated."""

    model_config = ConfigDict(extra="forbid", validate_default=True, populate_by_name=True)


class RedisConfig(Section):
    url: str | None = None
    """Redis URL (``redis://host:port/db``). None: ``rlbus run`` starts a private redis-server; other roles fail."""

    maxlen: int = Field(100_000, ge=1)
    """Approximate MAXLEN of every stream (XADD ``MAXLEN ~``); older entries are trimmed."""

    claim_idle_ms: int = Field(60_000, ge=100)
    """A pending entry idle this long (its consumer presumed dead) is reclaimed by another consumer."""

    block_ms: int = Field(1_000, ge=1)
    """XREADGROUP/XREAD BLOCK timeout; bounds how fast a worker notices a stop request."""

    max_deliveries: int = Field(5, ge=1)
    """An entry delivered this many times without an ack goes to ``dead``."""

    reconnect_timeout_s: float = Field(60.0, ge=0)
    """How long a Redis call keeps retrying while the server is unreachable (a restart, a blip, a failover),
    reconnecting with exponential backoff from 0.1 s up to 5 s between tries; past it the call fails and the
    worker exits for its supervisor to restart. 0: fail at once."""


class LogConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level."""

    json_lines: bool = Field(False, validation_alias=AliasChoices("json", "json_lines"))
    """Log JSON lines instead of the console format (``--log.json``)."""


