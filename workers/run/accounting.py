"""The run's group accounting for ``summary.json``: every training group produced ends up somewhere.

produced = trained + filtered + stale + dead-lettered + in flight, each term counted on its own
(the rollout workers', packer's and filter's metrics rows — each written in the same commit as the groups
it counts —, the dead letters, the entries still pending or undelivered), so ``unaccounted`` (produced
minus the rest) is a real check and should be 0. Eval groups, and dead letters that are not a training
group (garbage written into a stream), are left out everywhere. The streams themselves are trimmed as they
are consumed, so they are not where groups are counted.
"""

from bus.errors import DecodeError
from bus.keys import GROUP_FILTER, GROUP_PACKER
from bus.messages import DeadLetter, RolloutGroup, decode
from bus.resp import as_str
from bus.streams import Bus
from workers.config import RlbusConfig


async def group_counts(bus: Bus, config: RlbusConfig, rows: list[dict], trained: int) -> dict[str, int]:
    """The run's group counts (see the module docstring); ``rows`` are the metrics rows, ``trained`` the step."""
    packed: dict[int, float] = {}
    stale = filtered = produced = 0.0
    for row in rows:
        if row["source"] == "rollout":
            produced += float(row.get("rollout/train_groups", 0.0))
        if row["source"] == "packer" and row.get("step") is not None:
            packed[int(row["step"])] = float(row.get("packer/groups", 0.0))
            stale += float(row.get("packer/stale_groups", 0.0))
        filtered += float(row.get("filter/groups_dropped", 0.0))
    trained_groups = sum(v for s, v in packed.items() if s <= trained)
    in_batches = sum(v for s, v in packed.items() if s > trained)
    waiting = 0
    for env in config.env:
        waiting += await _unconsumed(bus, bus.keys.rollouts(env.resolved_name), GROUP_FILTER)
        waiting += await _unconsumed(bus, bus.keys.filtered(env.resolved_name), GROUP_PACKER)
    dead = await dead_groups(bus)
    counts = {"produced": int(produced), "trained": int(trained_groups), "filtered": int(filtered), "stale": int(stale),
              "dead_lettered": dead, "in_flight": int(waiting + in_batches)}
    counts["unaccounted"] = produced - sum(v for k, v in counts.items() if k != "produced")
    return counts


async def _count_training(bus: Bus, stream: str, start: str, ids: set[str] | None = None) -> int:
    """Non-eval entries of ``stream`` from ``start`` (exclusive when prefixed with '('), or only ``ids``."""
    count = 0
    while True:
        rows = await bus.redis.xrange(stream, min=start, count=500)
        for raw_id, fields in rows:
            if (ids is None or as_str(raw_id) in ids) and b"eval_step" not in fields:
                count += 1
        if len(rows) < 500:
            return count
        start = "(" + as_str(rows[-1][0])


async def _unconsumed(bus: Bus, stream: str, group: str) -> int:
    """Non-eval entries of ``stream`` that ``group`` has not acked: pending plus not yet delivered."""
    if not await bus.redis.exists(stream):
        return 0
    info = {as_str(g["name"]): g
            for g in await bus.redis.xinfo_groups(stream)}
    if group not in info:
        return await _count_training(bus, stream, "-")
    last = info[group]["last-delivered-id"]
    last = as_str(last)
    pending = await bus.redis.xpending_range(stream, group, min="-", max="+", count=100_000)
    ids = {as_str(p["message_id"]) for p in pending}
    undelivered = await _count_training(bus, stream, "(" + last)
    return undelivered + (await _count_training(bus, stream, "-", ids) if ids else 0)


async def dead_groups(bus: Bus) -> int:
    """Training groups dead-lettered from ``rollouts:*`` or ``filtered:*`` (eval groups excluded)."""
    count, start = 0, "-"
    while True:
        rows = await bus.redis.xrange(bus.keys.dead(), min=start, count=500)
        for _, fields in rows:
            stream = as_str(fields.get(b"stream", b""))
            family = bus.keys.family(stream) if stream.startswith(bus.keys.prefix) else ""
            if family in ("rollouts", "filtered") and _is_training_group(fields):
                count += 1
        if len(rows) < 500:
            return count
        start = "(" + as_str(rows[-1][0])


def _is_training_group(fields: dict) -> bool:
    """Whether a dead letter holds a training group (not an eval group, not bytes that never were a group)."""
    try:
        group = decode(DeadLetter.from_fields(fields).fields)
    except DecodeError:
        return False
    return isinstance(group, RolloutGroup) and group.eval_step is None
