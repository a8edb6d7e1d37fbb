"""The atomic commit as one Lua script: it writes only while this consumer still owns what it acks, and once.

A stage acks its inputs and publishes its outputs in one step. Between its read and its commit
another consumer may have reclaimed an input (this one was stalled past ``claim_idle_ms``), so the
script checks that first, inside Redis and in the same atomic step as the writes (a read-then-write
from Python would race): for each ack, ``XPENDING key group id id 1 consumer`` must list the entry.
Then the optional guard (a state-hash field must hold an expected value), then XACK, XADD and the
extra commands.

Each commit carries a random id. When its reply is lost (the connection drops after Redis ran it),
redis-py re-sends the very same script call; the first run left a record ``commit:{id}`` holding its
reply, so the re-send returns that reply and writes nothing: a commit without acks is not applied
twice, a guarded one is not refused by its own first run, and a stage's is not mistaken for a
reclaimed input. The record lives :func:`record_ttl_ms`, longer than redis-py retries.

The extra commands are recorded from the same redis-py calls a pipeline takes
(``extra(commands)`` calls ``commands.hincrby(...)``); their first argument is a key of the run.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.commands.core import CoreCommands

from bus.errors import RlbusError
from bus.resp import RespArgs

COMMIT_LUA = """
local done = redis.call('GET', KEYS[1])
if done then return cjson.decode(done) end
local consumer, ttl, i = ARGV[1], ARGV[2], 3
local function key() local k = KEYS[tonumber(ARGV[i])]; i = i + 1; return k end
local function arg() local a = ARGV[i]; i = i + 1; return a end
local acks = {}
for a = 1, tonumber(arg()) do
  local stream, group, id = key(), arg(), arg()
  if #redis.call('XPENDING', stream, group, id, id, 1, consumer) == 0 then
    return {'not_owned', stream, id}
  end
  acks[a] = {stream, group, id}
end
if arg() == '1' then
  local hash, fld, present, expected = key(), arg(), arg(), arg()
  local current = redis.call('HGET', hash, fld)
  if (present == '0' and current) or (present == '1' and current ~= expected) then
    return {'conflict', hash, fld, current or ''}
  end
end
for _, ack in ipairs(acks) do redis.call('XACK', ack[1], ack[2], ack[3]) end
local ids = {'ok'}
for _ = 1, tonumber(arg()) do
  local stream, maxlen, pairs = key(), arg(), tonumber(arg())
  local cmd = {'XADD', stream, 'MAXLEN', '~', maxlen, '*'}
  if maxlen == '0' then cmd = {'XADD', stream, '*'} end
  for _ = 1, 2 * pairs do cmd[#cmd + 1] = arg() end
  ids[#ids + 1] = redis.call(unpack(cmd))
end
for _ = 1, tonumber(arg()) do
  local n = tonumber(arg())
  local cmd = {arg(), key()}
  for _ = 3, n do cmd[#cmd + 1] = arg() end
  redis.call(unpack(cmd))
end
redis.call('SET', KEYS[1], cjson.encode(ids), 'PX', ttl)
return ids
"""
"""KEYS[1]: this commit's record (its reply once it ran; the script returns that reply when the record exists).
ARGV: consumer, the record's TTL (ms), then the acks (count; key index, group, id each), the guard (flag; key index,
field, present flag, expected), the XADDs (count; key index, maxlen (0: none), pair count, fields and values each) and
the extra commands (count; argument count, name, key index, the other arguments each). KEYS: the record, then every
key touched."""

RECORD_MARGIN_S = 60.0
"""How long a commit's record outlives redis-py's retry window (``redis.reconnect_timeout_s``): the tries themselves
and their connects take time beyond the backoff waits."""


def record_ttl_ms(reconnect_timeout_s: float) -> int:
    """How long a commit's record stays: past the last moment redis-py may re-send the commit."""
    return int((reconnect_timeout_s + RECORD_MARGIN_S) * 1000)

RENEW_LUA = """
local lost = {}
for k = 1, #KEYS do
  local id = ARGV[2 + k]
  if #redis.call('XPENDING', KEYS[k], ARGV[1], id, id, 1, ARGV[2]) == 0 then
    lost[#lost + 1] = k - 1
  else
    redis.call('XCLAIM', KEYS[k], ARGV[1], ARGV[2], 0, id, 'JUSTID')
  end
end
return lost
"""
"""KEYS: one stream per held entry; ARGV: group, consumer, then the entry ids. Returns the (0-based) positions
of the entries this consumer no longer owns; the others get their idle time reset (JUSTID: the delivery count stays)."""


class CommitConflict(RlbusError):
    """A commit guard did not hold (another worker moved first); nothing was written."""


class NotOwned(CommitConflict):
    """An input of the commit is no longer pending for this consumer (reclaimed by another, or acked by an earlier
    commit of this consumer); nothing was written."""


class CommandRecorder(CoreCommands):
    """Takes redis-py command calls (``hincrby``, ``hset``, …) and keeps their argument lists instead of sending
    them."""

    def __init__(self) -> None:
        self.commands: list[tuple[Any, ...]] = []

    def execute_command(self, *args: Any, **options: Any) -> "CommandRecorder":
        self.commands.append(args)
        return self


@dataclass
class CommitArgs:
    """KEYS and ARGV of one run of :data:`COMMIT_LUA`."""

    consumer: str
    keys: list[str] = field(default_factory=list)
    argv: list[Any] = field(default_factory=list)

    def key(self, name: str) -> int:
        """The 1-based KEYS index of ``name`` (added when new)."""
        if name not in self.keys:
            self.keys.append(name)
        return self.keys.index(name) + 1


def commit_args(
    record: tuple[str, int],
    consumer: str,
    acks: list[tuple[str, str, str]],
    outputs: list[tuple[str, RespArgs]],
    maxlen: Callable[[str], int | None],
    extra: Callable[[CommandRecorder], None] | None,
    guard: tuple[str, str, str | None] | None,
) -> CommitArgs:
    """Encode one commit for :data:`COMMIT_LUA` (``record``: the key of its record and that record's TTL in ms;
    ``outputs``: stream and the entry's fields and values as :class:`~bus.resp.RespArgs`; ``maxlen(stream)``: its
    MAXLEN, None for none)."""
    args = CommitArgs(consumer)
    record_key, ttl_ms = record
    args.key(record_key)
    argv = [consumer, ttl_ms, len(acks)]
    for stream, group, entry_id in acks:
        argv += [args.key(stream), group, entry_id]
    if guard is None:
        argv.append("0")
    else:
        hash_key, name, expected = guard
        argv += ["1", args.key(hash_key), name, "0" if expected is None else "1", expected or ""]
    argv.append(len(outputs))
    for stream, fields in outputs:
        argv += [args.key(stream), maxlen(stream) or 0, fields.count // 2, fields]
    recorder = CommandRecorder()
    if extra is not None:
        extra(recorder)
    argv.append(len(recorder.commands))
    for name, target, *rest in recorder.commands:
        argv += [2 + len(rest), name, args.key(target), *rest]
    args.argv = argv
    return args
