"""Logging through structlog: fixed snake_case event names with key-value pairs.

Console lines by default, JSON lines with ``--log.json``. Bind ``worker``, ``run``, ``stream``,
``step`` once per worker::

    log = get_logger(worker="packer", run=config.run.name)
    log.info("batch_packed", step=3, samples=128)
"""

import logging
import sys
from typing import Any

import structlog

from bus.config import LogConfig


def configure_logging(cfg: LogConfig | None = None) -> None:
    """Route every structlog logger to stderr at ``cfg.level``, as console text or JSON lines."""
    cfg = cfg or LogConfig()
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if cfg.json_lines:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, cfg.level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(**bind: Any) -> structlog.typing.FilteringBoundLogger:
    """A logger with ``bind`` attached to every line (worker, run, stream, step, …)."""
    return structlog.get_logger().bind(**bind)
