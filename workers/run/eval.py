"""Eval: issue eval tasks at the configured steps, aggregate the groups, report pass@k / mean reward.

Routing (see PLAN "Changes", H7): for eval step ``s`` the coordinator publishes
``Task(eval_step=s)`` to ``tasks:{env}`` (``[[eval.env]]`` names); rollout workers wait until every
inference server serves at least version ``s`` (never dropped as stale) and publish the group with
``eval_step`` set to ``rollouts:{env}``; the filter acks and skips such groups; the aggregator here
reads ``rollouts:{env}`` with its own consumer group ``eval``, acks training groups by their header
without decoding them, and once all groups of ``(env, s)`` are in, publishes one
``Metric(source="eval", step=s)`` and acks those groups in the same commit.

Eval steps: 0 (unless ``eval.skip_first_step``), every ``interval`` steps, and ``run.max_steps``.
The eval of step ``s`` runs on exactly version ``s``: the coordinator keeps the run's state field
``eval:hold`` at the next eval step not yet finished, and inference servers never serve weights
newer than the hold (training runs on up to ``max_off_policy_steps`` ahead, then waits).
Binary rewards (every reward 0 or 1) report ``pass@k`` for k = 1, 2, 4, … ≤ group_size with the
unbiased estimator ``1 − C(n−c, k) / C(n, k)`` (Chen et al., 2021); others report the mean reward.
"""

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bus.entries import Entry
from bus.errors import DecodeError
from bus.keys import GROUP_EVAL
from bus.log import get_logger
from bus.messages import DeadLetter, Metric, RolloutGroup, Task, decode
from bus.policy import PolicyTracker
from bus.state import EVAL_HOLD_FIELD, eval_done_field, eval_issued_field
from bus.streams import Bus
from workers.config import RlbusConfig
from workers.env_config import EvalEnvConfig

READ_COUNT = 256
"""Entries of ``rollouts:*`` read per call."""

PENDING_READ_COUNT = 1000
"""Pending entries replayed per call at setup."""


def _training_group(fields: dict[bytes, bytes]) -> bool:
    """Whether a ``rollouts:*`` entry is a training group (no ``eval_step`` header): eval acks it unread."""
    return b"eval_step" not in fields


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one example: n samples, c correct → 1 − C(n−c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 ≤ c ≤ n and 1 ≤ k ≤ n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def k_values(n: int) -> list[int]:
    """k = 1, 2, 4, … up to n (and n itself)."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def eval_values(env: str, rewards_by_example: list[list[float]]) -> dict[str, float]:
    """The metrics of one eval: mean reward always; pass@k when every reward is 0 or 1."""
    flat = [r for rewards in rewards_by_example for r in rewards]
    values = {f"eval/{env}/reward": sum(flat) / len(flat), f"eval/{env}/examples": float(len(rewards_by_example))}
    if all(r in (0.0, 1.0) for r in flat):
        n = min(len(r) for r in rewards_by_example)
        for k in k_values(n):
            per_example = [pass_at_k(len(r), int(sum(r)), k) for r in rewards_by_example]
            values[f"eval/{env}/pass@{k}"] = sum(per_example) / len(per_example)
    return values


def is_eval_step(step: int, interval: int, max_steps: int | None, skip_first: bool) -> bool:
    """Whether ``step`` is on the eval schedule: 0 (unless skipped), multiples of ``interval``, ``max_steps``."""
    if max_steps is not None and step > max_steps:
        return False
    return (step == 0 and not skip_first) or (step > 0 and (step % interval == 0 or step == max_steps))


def next_eval_step(after: int | None, interval: int, max_steps: int | None, skip_first: bool) -> int | None:
    """The first scheduled eval step after ``after`` (None: from the start); None when there is none left."""
    first = 0 if after is None else after + 1
    if is_eval_step(first, interval, max_steps, skip_first):
        return first
    step = max(interval, -(-first // interval) * interval)
    if max_steps is not None:
        step = min(step, max_steps)
    return step if step >= first and is_eval_step(step, interval, max_steps, skip_first) else None


def eval_steps_due(trained: int, issued: int | None, interval: int, max_steps: int | None,
                   skip_first: bool) -> int | None:
    """The next eval step to issue now (the oldest scheduled one after ``issued`` that is ≤ trained), or None."""
    step = next_eval_step(issued, interval, max_steps, skip_first)
    return step if step is not None and step <= trained else None


@dataclass
class _Pending:
    """The groups of one (env, step) eval received so far."""

    expected: int
    groups: dict[str, RolloutGroup] = field(default_factory=dict)
    entries: list[tuple[str, str]] = field(default_factory=list)
    dead: set[str] = field(default_factory=set)
    """Task ids of this eval that went to ``dead``: done, with no group."""
    started: float = field(default_factory=time.monotonic)

    @property
    def answered(self) -> int:
        return len(self.groups) + len(self.dead - set(self.groups))


class EvalCoordinator:
    """Issues eval tasks as ``trained`` advances and aggregates the eval groups into metrics."""

    def __init__(self, config: RlbusConfig, bus: Bus, sizes: dict[str, int]):
        self.config = config
        self.bus = bus
        self.tracker = PolicyTracker(bus)
        self.envs: dict[str, EvalEnvConfig] = {e.resolved_name: e for e in config.eval.env}
        self.indices = {name: self._indices(env, sizes[name]) for name, env in self.envs.items()}
        self.pending: dict[tuple[str, int], _Pending] = {}
        self.finished: set[tuple[str, int]] = set()
        self.issued: dict[str, int | None] = {}
        """Each env's newest eval step issued, as :meth:`issue_due` last found it."""
        self.log = get_logger(worker="eval", run=config.run.name)
        self.dead_last_id = "0"
        """Where the coordinator reads ``dead`` from: set at setup to its end (older evals are done or time out)."""

    def _indices(self, env: EvalEnvConfig, size: int) -> list[int]:
        if env.num_examples < 0 or env.num_examples >= size:
            return list(range(size))
        return sorted(random.Random(self.config.run.seed).sample(range(size), env.num_examples))

    @property
    def streams(self) -> list[str]:
        return [self.bus.keys.rollouts(name) for name in self.envs]

    async def setup(self) -> None:
        """Groups, the hold for the first eval (before any server loads newer weights), pending groups."""
        await self.update_hold()
        self.dead_last_id = await self.bus.last_id(self.bus.keys.dead())
        for stream in self.streams:
            await self.bus.ensure_group(stream, GROUP_EVAL)
        # Groups read before a restart and not yet aggregated are pending for this consumer: read them first.
        for stream in self.streams:
            after: str | None = "0"
            while after is not None:
                entries, after = await self.bus.read_pending(stream, GROUP_EVAL, after, count=PENDING_READ_COUNT,
                                                             skip=_training_group)
                await self._take(entries)

    async def update_hold(self) -> int | None:
        """Set ``eval:hold`` to the next eval step some env has not finished (delete it when none is left)."""
        nexts = []
        for name, env in self.envs.items():
            raw = await self.bus.state_get(eval_done_field(name))
            nexts.append(next_eval_step(None if raw is None else int(raw), self.config.eval_interval(env),
                                        self.config.run.max_steps, self.config.eval.skip_first_step))
        hold = min((n for n in nexts if n is not None), default=None)
        if hold is None:
            await self.bus.redis.hdel(self.bus.keys.state(), EVAL_HOLD_FIELD)
        else:
            await self.bus.state_set(**{EVAL_HOLD_FIELD: hold})
        return hold

    async def issue_due(self) -> None:
        """Publish the eval tasks of the newest due eval step of each env (once per step)."""
        await self.tracker.refresh()
        for name, env in self.envs.items():
            field_name = eval_issued_field(name)
            raw = await self.bus.state_get(field_name)
            issued = self.issued[name] = int(raw) if raw is not None else None
            step = eval_steps_due(self.tracker.trained, issued, self.config.eval_interval(env),
                                  self.config.run.max_steps, self.config.eval.skip_first_step)
            if step is None:
                continue
            tasks = [
                (self.bus.keys.tasks(name), Task(
                    task_id=f"eval:{name}:{step}:{i}", env=name, example_index=i, example_id=str(i),
                    group_size=env.group_size, mode="rl", eval_step=step,
                ))
                for i in self.indices[name]
            ]
            await self.bus.commit([], tasks,
                                  extra=lambda pipe, f=field_name, s=step: pipe.hset(self.bus.keys.state(), f, s))
            self.pending.setdefault((name, step), _Pending(expected=len(tasks)))
            self.issued[name] = step
            self.log.info("eval_issued", env=name, step=step, tasks=len(tasks))

    async def run(self, on_finished: Callable[[], None]) -> None:
        """Issue each eval as soon as its step is trained and collect the groups; ``on_finished()`` after each eval
        that finishes (``rlbus run`` may end on it)."""
        issuing = asyncio.ensure_future(self.issue_on_time(block_ms=1000))
        try:
            while True:
                finished = len(self.finished)
                await self.collect(block_ms=500)
                if issuing.done() and issuing.exception() is not None:
                    raise issuing.exception()
                if len(self.finished) > finished:
                    on_finished()
        finally:
            issuing.cancel()
            await asyncio.gather(issuing, return_exceptions=True)

    def next_due(self) -> int | None:
        """The step at which the next eval of some env falls due (None: none left); after :meth:`issue_due`."""
        steps = [next_eval_step(self.issued.get(name), self.config.eval_interval(env), self.config.run.max_steps,
                                self.config.eval.skip_first_step) for name, env in self.envs.items()]
        return min((s for s in steps if s is not None), default=None)

    async def issue_on_time(self, block_ms: int) -> None:
        """Issue every eval as soon as its step is trained: :meth:`issue_due`, then block on the ``policy`` stream
        until the next one falls due; returns once none is left."""
        while True:
            await self.issue_due()
            due = self.next_due()
            if due is None:
                return
            while self.tracker.trained < due:
                await self.tracker.refresh(block_ms=block_ms, live=False)

    async def collect(self, block_ms: int | None = None) -> None:
        """Read new entries of ``rollouts:*``; ack training groups; finish complete evals."""
        await self._take(await self.bus.read_group(self.streams, GROUP_EVAL, count=READ_COUNT, block_ms=block_ms,
                                                   skip=_training_group))
        await self._take_dead()
        timeout_s = self.config.eval.timeout_s
        for key, pending in list(self.pending.items()):
            if pending.answered >= pending.expected:
                await self._finish(*key)
            elif timeout_s is not None and time.monotonic() - pending.started > timeout_s:
                self.log.warning("eval_timed_out", env=key[0], step=key[1], groups=len(pending.groups),
                                 expected=pending.expected, timeout_s=timeout_s)
                await self._finish(*key, timed_out=True)

    async def _take_dead(self) -> None:
        """Eval tasks that went to ``dead`` (an env that broke, a worker that gave up): done, without a group."""
        for entry_id, letter in await self.bus.read_fanout(self.bus.keys.dead(), self.dead_last_id, count=1000):
            self.dead_last_id = entry_id
            if not isinstance(letter, DeadLetter):
                continue
            try:
                task = decode(letter.fields)
            except DecodeError:
                continue
            if isinstance(task, Task) and task.eval_step is not None:
                pending = self.pending.get((task.env, task.eval_step))
                if pending is not None:
                    pending.dead.add(task.task_id)

    async def _take(self, entries: list[Entry]) -> None:
        for entry in entries:
            group = entry.message
            if not isinstance(group, RolloutGroup):
                await self.bus.dead_letter(entry, reason=f"expected a rollout group, got {group.KIND!r}",
                                           group=GROUP_EVAL)
                continue
            pending = self.pending.setdefault(
                (group.env, group.eval_step), _Pending(expected=len(self.indices.get(group.env, [])))
            )
            pending.groups[group.task_id] = group
            pending.entries.append((entry.stream, entry.id))

    async def _finish(self, env: str, step: int, timed_out: bool = False) -> None:
        pending = self.pending.pop((env, step))
        groups = sorted(pending.groups.values(), key=lambda g: g.example_index)
        values = eval_values(env, [[s.reward for s in g.samples] for g in groups]) if groups else {}
        versions = [v for g in groups for s in g.samples for v in (s.policy_version_start, s.policy_version_end)]
        if versions:
            values[f"eval/{env}/policy_version_min"] = float(min(versions))
            values[f"eval/{env}/policy_version_max"] = float(max(versions))
        values[f"eval/{env}/seconds"] = time.monotonic() - pending.started
        values[f"eval/{env}/groups_missing"] = float(pending.expected - len(groups))
        values[f"eval/{env}/timed_out"] = float(timed_out)
        acks = [(stream, GROUP_EVAL, entry_id) for stream, entry_id in pending.entries]
        done = eval_done_field(env)
        await self.bus.commit(acks, [(self.bus.keys.metrics(), Metric(source="eval", step=step, values=values))],
                              extra=lambda pipe: pipe.hset(self.bus.keys.state(), done, step))
        self.finished.add((env, step))
        await self.update_hold()
        self.log.info("eval_finished", env=env, step=step, reward=values.get(f"eval/{env}/reward"),
                      groups=len(groups), missing=pending.expected - len(groups))

    def complete(self, step: int) -> bool:
        """True once every eval env has finished its eval of ``step``."""
        return all((name, step) in self.finished for name in self.envs)
