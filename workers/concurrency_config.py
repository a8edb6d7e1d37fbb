"""``[rollout.concurrency]``: adaptive rollout concurrency (:mod:`workers.stages.concurrency`)."""

from pydantic import Field, model_validator

from bus.config import Section


class ConcurrencyConfig(Section):
    adaptive: bool = False
    """Grow and trim each rollout worker's groups in flight from the inference servers' load (AIMD: +1 group an
    interval while they have headroom, ×``decrease`` when their queues grow, they preempt or the latency per token
    rises), starting at ``rollout.max_concurrent_groups``; false: ``max_concurrent_groups`` is the fixed limit.
    Off by default: on the CPU default it measured within the noise of the best fixed setting, and slower with a
    slow env, where the shared cores make the latency signal cut (benchmarks/README.md)."""

    floor: int = Field(1, ge=1)
    """Fewest groups in flight the controller keeps."""

    ceiling: int = Field(64, ge=1)
    """Most groups in flight the controller allows (the staleness gate bounds what runs regardless)."""

    interval_s: float = Field(1.0, gt=0, le=60)
    """How often the worker polls the servers (``/health`` of the built-in one, ``/metrics`` of vLLM) and moves
    the limit; a poll is bounded by this too, and a server that does not answer holds the limit."""

    decrease: float = Field(0.7, gt=0, lt=1)
    """Factor of a cut (at least one group)."""

    use_threshold: float = Field(0.9, gt=0, le=1)
    """KV-cache use (vLLM) or batch-slot use (built-in server) at or above which the limit stops growing."""

    latency_factor: float = Field(2.0, gt=1)
    """A cut when the latency per generated token passes this × its best of the last 30 polls; growth stops past
    half that margin."""

    @model_validator(mode="after")
    def _bounds(self):
        if self.floor > self.ceiling:
            raise ValueError(f"rollout.concurrency.floor={self.floor} exceeds ceiling={self.ceiling}; lower the "
                              "floor or raise the ceiling")
        return self
