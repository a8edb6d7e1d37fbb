"""The run's group accounting for ``summary.json``: every training group produced ends up somewhere.

produced = trained + filtered + stale + dead-lettered + in flight, each term counted on its own
(the rollout workers', packer's and filter's metrics rows — each written in the same commit as the groups
it counts —, the dead letters, the entries still pending or undelivered), so ``unaccounted`` (produced
minus the rest) is a real check and should be 0. Eval groups, and dead letters that are not a training
group (garbage written into a stream), are left out everywhere. The streams themselves are trimmed as they
are consumed, so they are not where groups are counted.
"""

from bus.errors import DecodeError
from bus.messages import DeadLetter, RolloutGroup, decode
from bus.state import unconsumed_entries
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
    unconsumed = await unconsumed_entries(bus, [env.resolved_name for env in config.env])
    waiting = sum(n for stream, n in unconsumed.items() if bus.keys.family(stream) in ("rollouts", "filtered"))
    dead = await dead_groups(bus)
    counts = {"produced": int(produced), "trained": int(trained_groups), "filtered": int(filtered), "stale": int(stale),
              "dead_lettered": dead, "in_flight": int(waiting + in_batches)}
    counts["unaccounted"] = produced - sum(v for k, v in counts.items() if k != "produced")
    return counts


async def dead_groups(bus: Bus) -> int:
    """Training groups dead-lettered from ``rollouts:*`` or ``filtered:*`` (eval groups excluded)."""
    count = 0
    async for _, letter in bus.read_all(bus.keys.dead()):
        if not isinstance(letter, DeadLetter):
            continue
        family = bus.keys.family(letter.stream) if letter.stream.startswith(bus.keys.prefix) else ""
        if family in ("rollouts", "filtered") and _is_training_group(letter):
            count += 1
    return count


def _is_training_group(letter: DeadLetter) -> bool:
    """Whether a dead letter holds a training group (not an eval group, not bytes that never were a group)."""
    try:
        group = decode(letter.fields)
    except DecodeError:
        return False
    return isinstance(group, RolloutGroup) and group.eval_step is None
