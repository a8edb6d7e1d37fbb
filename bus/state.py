"""Every field of a run's state hash (``Keys.state()``), and the in-flight release hook.

The state hash holds a run's small counters and cursors. Each field is named here once; the
stages that move a field do so in the same MULTI as the stream writes it accounts for.
"""

from collections.abc import Callable

from bus.commit import CommandRecorder
from bus.messages import RolloutGroup, Task
from bus.streams import Entry

INFLIGHT_FIELD = "inflight"
"""Samples issued by the feeder and not yet consumed by the packer (dropped, dead-lettered)."""

LAST_STEP_FIELD = "packer:last_step"
"""The last step whose micro-batches the packer published."""

STREAK_FIELD = "zero_variance_streak"
"""Consecutive rl groups (of ≥ 2 samples) with zero reward variance (the filter's collapse check)."""

STOP_REASON_FIELD = "stop_reason"
"""Why the run stopped (set by the filter on collapse; read by ``rlbus run`` and the status panel)."""

RUN_EPOCH_FIELD = "run:epoch"
"""A random id the trainer writes when the run first trains; every checkpoint carries it, so a trainer resuming
onto a Redis that lost the run (wiped, a new volume, another server) notices instead of starting over."""

EVAL_HOLD_FIELD = "eval:hold"
"""Inference servers serve no weights newer than this step while evals run (absent: no hold)."""


def cursor_field(env: str) -> str:
    """The feeder's next position within the current epoch of ``env``."""
    return f"feeder:cursor:{env}"


def epoch_field(env: str) -> str:
    """The feeder's current epoch of ``env``."""
    return f"feeder:epoch:{env}"


def eval_issued_field(env: str) -> str:
    """The last eval step whose tasks were published for eval env ``env``."""
    return f"eval:issued:{env}"


def eval_done_field(env: str) -> str:
    """The last eval step of eval env ``env`` whose metrics were published."""
    return f"eval:done:{env}"


def release_inflight(state_key: str) -> Callable[[Entry, CommandRecorder], None]:
    """An ``on_dead`` hook for Bus.reclaim: a training task or group dead-lettered between the feeder and
    the packer gives its samples back to the in-flight count (eval work never counted)."""

    def release(entry: Entry, pipe: CommandRecorder) -> None:
        message = entry.message
        if isinstance(message, Task) and message.eval_step is None:
            pipe.hincrby(state_key, INFLIGHT_FIELD, -message.group_size)
        elif isinstance(message, RolloutGroup) and message.eval_step is None:
            pipe.hincrby(state_key, INFLIGHT_FIELD, -len(message.samples))

    return release
