"""The run's monitoring sections: the terminal status block, the Prometheus exporter and W&B."""

from typing import Literal

from pydantic import AliasChoices, Field

from bus.config import Section


class StatusConfig(Section):
    log_interval_seconds: float = Field(60.0, gt=0)
    """Off a terminal, ``rlbus run`` prints a short line per step and a full ``[status]`` block this often
    (ART's ``log_interval_seconds``). On a terminal the live panel shows everything instead."""

    ewa_alpha: float = Field(0.2, gt=0, le=1, validation_alias=AliasChoices("ewa_alpha", "status_ewa_alpha"))
    """Weight of the newest step in the block's smoothed values (ART's ``status_ewa_alpha``)."""


class ExporterConfig(Section):
    port: int = Field(9400, ge=0, le=65535)
    """Port of the Prometheus metrics (``/metrics``) that ``rlbus exporter`` and ``rlbus run`` serve; 0: any free
    port. ``rlbus run`` takes a free one when this one is in use, and prints it."""

    in_run: bool = True
    """Whether ``rlbus run`` (``--attach`` too) serves the metrics itself; false where ``rlbus exporter`` runs as
    its own service (compose, Kubernetes)."""

    host: str = "0.0.0.0"
    """Address the metrics server listens on."""

    poll_s: float = Field(1.0, gt=0, le=10)
    """Longest wait of one blocking read of the run's streams (a new entry ends it at once); also the pause after
    a failed read."""


class WandbConfig(Section):
    project: str
    """W&B project."""

    name: str | None = None
    """W&B run name; None = run.name."""

    mode: Literal["online", "offline"] = "offline"
    """offline writes locally (``wandb sync`` later)."""
