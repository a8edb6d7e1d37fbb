"""Every field of a run's state hash (``Keys.state()``), and the in-flight release hook.

The state hash holds a run's small counters and cursors. Each field is named here once; the
stages that move a field do so in the same MULTI as the stream writes it accounts for.
"""

from collections.abc import Callable

from bus.commit import CommandRecorder
from bus.entries import Entry
from bus.keys import GROUP_FILTER, GROUP_PACKER, GROUP_ROLLOUT
from bus.messages import RolloutGroup, Task
from bus.streams import Bus

INFLIGHT_FIELD = "inflight"
"""Samples issued by the feeder and not yet consumed by the packer (dropped, dead-lettered)."""

LAST_STEP_FIELD = "packer:last_step"
"""The last step whose micro-batches the packer published."""

STREAK_FIELD = "zero_variance_streak"
"""Consecutive rl groups (of ≥ 2 samples) with zero reward variance (the filter's collapse check)."""

STOP_REASON_FIELD = "stop_reason"
"""Why the run stopped (set by the filter on collapse; read by ``rlbus run`` and the status panel)."""

FEEDER_DONE_FIELD = "feeder:done"
"""The ``feeder.max_epochs`` every env has issued (set when the last task is out). It counts only for a config with
that same ``max_epochs``: a run resumed with more epochs is not exhausted."""

DATA_EXHAUSTED = "data exhausted"
"""The ``stop_reason`` of a run whose data ran out: the packer sets it once the last (partial) step is built."""

EXHAUSTED_EPOCHS_FIELD = "packer:exhausted_epochs"
"""The ``feeder.max_epochs`` the packer found exhausted, written with the stop reason: a run resumed with more
epochs is not over, whatever the old stop reason says."""

RUN_EPOCH_FIELD = "run:epoch"
"""A random id the trainer writes when the run first trains; every checkpoint carries it, so a trainer resuming
onto a Redis that lost the run (wiped, a new volume, another server) notices instead of starting over."""

TRAINER_FIELD = "trainer"
"""``{holder}@{step}``: the trainer that holds the trainer lease and the last step it published. Each publication
is a commit guarded on the value it last wrote, so a trainer that was replaced (a standby took over) or a Redis
that went back to an older copy of the run (its steps are behind the trainer's) refuses the write."""

EVAL_HOLD_FIELD = "eval:hold"
"""Inference servers serve no weights newer than this step while evals run (absent: no hold)."""


async def exhausted_at(bus: Bus, max_epochs: int | None) -> int | None:
    """The last step of a run whose data ran out (``stop_reason`` = :data:`DATA_EXHAUSTED` for these
    ``max_epochs``), or None while more data may come."""
    fields = [STOP_REASON_FIELD, EXHAUSTED_EPOCHS_FIELD, LAST_STEP_FIELD]
    reason, epochs, last = await bus.redis.hmget(bus.keys.state(), fields)
    if max_epochs is None or reason is None or epochs is None:
        return None
    if reason.decode() != DATA_EXHAUSTED or epochs.decode() != str(max_epochs):
        return None
    return int(last or 0)


def is_progress_field(name: str) -> bool:
    """Whether a state field is part of the data position a checkpoint keeps: the feeder's cursors and epochs,
    and which evals were issued and done."""
    return name.startswith(("feeder:", "eval:issued:", "eval:done:"))


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


_UNCONSUMED_LUA = """
local total, counts = 0, {}
for k = 2, #KEYS do
  local stream, group, field = KEYS[k], ARGV[2 * k - 2], ARGV[2 * k - 1]
  local entries = 0
  if redis.call('EXISTS', stream) == 1 then
    local last, found = '0-0', false
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
      local info = {}
      for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
      if info['name'] == group then last, found = info['last-delivered-id'], true end
    end
    local function add(entry)
      local count, eval = 0, false
      for i = 1, #entry[2], 2 do
        local name = entry[2][i]
        if name == field then count = tonumber(entry[2][i + 1]) or 0 end
        if name == 'eval_step' then eval = true end
      end
      if not eval then total, entries = total + count, entries + 1 end
    end
    for _, entry in ipairs(redis.call('XRANGE', stream, '(' .. last, '+')) do add(entry) end
    if found then
      for _, p in ipairs(redis.call('XPENDING', stream, group, '-', '+', 1000000000)) do
        for _, entry in ipairs(redis.call('XRANGE', stream, p[1], p[1])) do add(entry) end
      end
    end
  end
  counts[k - 1] = entries
end
local current = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if ARGV[#ARGV] == 'correct' and current ~= total then redis.call('HSET', KEYS[1], ARGV[1], total) end
return {current, total, counts}
"""
"""Training entries not yet consumed by a stream's next group (undelivered, or pending), counted in one atomic
step. KEYS: the state hash, then the streams; ARGV: the in-flight field, a (group, header field) pair per stream,
then ``correct`` (set the field to the total) or ``count``. Returns the field's value, the total of the header
fields, and the number of entries per stream."""


def _unconsumed_streams(bus: Bus, envs: list[str]) -> list[tuple[str, str, str]]:
    """(stream, its consuming group, the header field holding its samples) of every hop between feeder and packer."""
    streams = [(bus.keys.tasks(e), GROUP_ROLLOUT, "group_size") for e in envs]
    streams += [(bus.keys.rollouts(e), GROUP_FILTER, "samples_count") for e in envs]
    return streams + [(bus.keys.filtered(e), GROUP_PACKER, "samples_count") for e in envs]


async def _unconsumed(bus: Bus, streams: list[tuple[str, str, str]], mode: str) -> list:
    keys = [bus.keys.state(), *(s for s, _, _ in streams)]
    args = [INFLIGHT_FIELD, *(a for _, group, field in streams for a in (group, field)), mode]
    return await bus.redis.eval(_UNCONSUMED_LUA, len(keys), *keys, *args)


async def unconsumed_entries(bus: Bus, envs: list[str]) -> dict[str, int]:
    """Per stream between feeder and packer: its training entries the next stage has not consumed yet."""
    streams = _unconsumed_streams(bus, envs)
    _, _, counts = await _unconsumed(bus, streams, "count")
    return {stream: int(n) for (stream, _, _), n in zip(streams, counts, strict=True)}


async def reconcile_inflight(bus: Bus, envs: list[str]) -> tuple[int, int]:
    """Recompute ``inflight`` from the streams, inside Redis in one atomic step, and correct it; returns
    ``(was, is)``. In flight = the training entries not yet consumed by the next stage's group (undelivered or
    pending): tasks (their ``group_size`` header), rollout and filtered groups (their ``samples_count``). Every
    commit moves the count together with the entries, so the two differ only after a lost release (an entry that
    could not be decoded at all, say); this puts them back in step."""
    was, now, _ = await _unconsumed(bus, _unconsumed_streams(bus, envs), "correct")
    return int(was), int(now)
