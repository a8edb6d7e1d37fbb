"""Every Redis key of a run, built in one place.

All keys share the prefix ``rlbus:{RUN}:``; the braces are literal (a Redis Cluster hash tag),
so a run's multi-key transactions stay on one slot. No other module spells a key.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    """The key family of one run."""

    run: str

    def __post_init__(self) -> None:
        if not self.run or any(c in self.run for c in "{}: \t\n*?[]"):
            raise ValueError(
                f"run name {self.run!r} is not usable in a Redis key; use letters, digits, '-', '_' or '.'"
            )

    @property
    def prefix(self) -> str:
        """``rlbus:{RUN}:``, the prefix of every key of this run."""
        return f"rlbus:{{{self.run}}}:"

    def tasks(self, env: str) -> str:
        """Stream feeder → rollout workers (group ``rollout``)."""
        return f"{self.prefix}tasks:{env}"

    def rollouts(self, env: str) -> str:
        """Stream rollout → filter (group ``filter``)."""
        return f"{self.prefix}rollouts:{env}"

    def filtered(self, env: str) -> str:
        """Stream filter → packer (group ``packer``)."""
        return f"{self.prefix}filtered:{env}"

    def batches(self, step: int) -> str:
        """Stream packer → trainer: the micro-batches of one step."""
        return f"{self.prefix}batches:{step}"

    def weights(self) -> str:
        """Stream trainer → inference servers (fan-out): weight update events."""
        return f"{self.prefix}weights"

    def policy(self) -> str:
        """Stream of policy versions: ``trained`` by the trainer, ``served`` by inference servers."""
        return f"{self.prefix}policy"

    def lease(self, role: str) -> str:
        """String key: the consumer holding ``role``'s lease (one active packer; the others are standbys)."""
        return f"{self.prefix}lease:{role}"

    def servers(self) -> str:
        """Sorted set of live inference servers: member = server id, score = its last heartbeat (Redis time, ms)."""
        return f"{self.prefix}servers"

    def workers(self) -> str:
        """Sorted set of worker heartbeats: member = ``{worker}@{host}``, score = its last beat (Redis time, ms)."""
        return f"{self.prefix}workers"

    def metrics(self) -> str:
        """Stream every worker → status display and metrics writers."""
        return f"{self.prefix}metrics"

    def barrier(self) -> str:
        """Pub/sub channel of replicated reads: a PUBLISH that stores nothing, sent so a WAIT on the reader's
        connection covers what it read (``Bus.read_fanout(replicated=True)``); nobody subscribes."""
        return f"{self.prefix}barrier"

    def dead(self) -> str:
        """Stream of dead letters: entries that failed too often or could not be decoded."""
        return f"{self.prefix}dead"

    def packed(self, env: str, epoch: int) -> str:
        """Bitmap of env ``env``'s epoch ``epoch``: bit ``p`` is set once the task at position ``p`` was consumed by the
        packer (packed or dropped as stale), so a second group for it is dropped."""
        return f"{self.prefix}packed:{env}:{epoch}"

    def commit(self, commit_id: str) -> str:
        """String key (TTL): the reply of one commit that ran, so a re-send of it (its reply was lost) returns that
        reply instead of writing again (:mod:`bus.commit`)."""
        return f"{self.prefix}commit:{commit_id}"

    def state(self) -> str:
        """Hash of small counters and cursors (feeder cursor, in-flight count, last packed step)."""
        return f"{self.prefix}state"

    def pattern(self) -> str:
        """A SCAN pattern matching every key of this run."""
        return f"{self.prefix}*"

    def family(self, key: str) -> str:
        """The family name (``tasks``, ``batches``, …) of one of this run's keys."""
        if not key.startswith(self.prefix):
            raise ValueError(f"{key!r} is not a key of run {self.run!r}")
        return key[len(self.prefix) :].split(":", 1)[0]

    def is_group_stream(self, key: str) -> bool:
        """Whether ``key`` is one of the run's consumer-group streams (:data:`GROUP_STREAMS`)."""
        return key.startswith(self.prefix) and self.family(key) in GROUP_STREAMS

    def suffix(self, key: str) -> str:
        """What follows the family name (the env or the step), or '' for run-wide keys."""
        rest = key[len(self.prefix) :].split(":", 1)
        return rest[1] if len(rest) == 2 else ""


GROUP_STREAMS = ("tasks", "rollouts", "filtered")
"""Families read through consumer groups: trimmed behind their slowest group (:meth:`bus.streams.Bus.trim_consumed`),
never by MAXLEN, which could drop an entry still pending or not yet delivered."""

# Consumer group names, one per consuming role.
GROUP_ROLLOUT = "rollout"
GROUP_FILTER = "filter"
GROUP_PACKER = "packer"
GROUP_EVAL = "eval"
