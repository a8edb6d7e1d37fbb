"""The filter worker: ``rollouts:{env}`` → advantages and pre-batch filters → ``filtered:{env}``.

For every group read (consumer group ``filter``): GRPO advantages over the whole group, then the
pre-batch filters (an enforcing filter drops the samples it flags; the dropped samples' rewards
already counted in the baseline). One ``Bus.commit`` per read holds the acks, the filtered
groups, a ``metrics`` entry and ``HINCRBY inflight −dropped``: the feeder's in-flight count
falls here only by the samples the enforced filters dropped (whole groups included); forwarded
samples stay in flight until the packer consumes them.

Collapse failsafe (ART's): the state field ``zero_variance_streak`` counts consecutive rl groups
whose rewards are all equal. The filter keeps it because it sees every group exactly once, before
any filter could drop one. At ``collapse_after()`` the filter sets ``stop_reason``, writes a
metric and exits with :class:`CollapseError`.
"""

import argparse
import asyncio
import sys
import time

from bus.commit import NotOwned
from bus.entries import Entry
from bus.errors import CollapseError, ConfigError
from bus.keys import GROUP_FILTER
from bus.log import get_logger
from bus.messages import Metric, RolloutGroup
from bus.state import INFLIGHT_FIELD, STOP_REASON_FIELD, STREAK_FIELD, release_inflight
from bus.streams import Bus
from workers.config import RlbusConfig
from workers.lifecycle import connect_bus, consumer_name, run_worker
from workers.stages.advantages import assign_advantages, zero_variance
from workers.stages.sample_filters import FilterCounts, active_filters, apply_filters, model_vocab_size

COLLAPSE_EXIT_CODE = 3
"""Exit status of a filter that stopped the run for collapse (the supervisor must not restart it)."""


def collapse_message(streak: int, limit: int) -> str:
    """What happened and which knobs to turn (ART's message, with rlbus's config names)."""
    return (
        f"model collapse: {streak} groups in a row had zero reward variance (every completion of a prompt got the "
        f"same reward), so every advantage is 0 and training has no signal; the run was stopped. "
        f"To improve training: lower trainer.lr; check that the env's reward separates good from bad completions; "
        f"use more diverse prompts or a higher sampling.temperature; use a smaller packer.batch_size. "
        f"To continue anyway: raise packer.collapse_after (now {limit}, default 100 × the batch in groups) and "
        f"restart, or reset the state field {STREAK_FIELD!r}."
    )


class FilterWorker:
    """Turns scored groups into filtered, advantage-annotated groups."""

    def __init__(self, config: RlbusConfig, worker: str | None = None, vocab_size: int | None = None):
        if not config.env:
            raise ConfigError("no [[env]] configured; the filter needs at least one env")
        self.config = config
        self.worker = consumer_name("filter", worker)
        self.vocab_size = vocab_size
        self.collapse_after = config.collapse_after()
        self.advantages = {e.resolved_name: e.advantage for e in config.env}
        """Each env's advantage settings ([filter.advantage] under the env's own fields)."""
        self.max_completion_tokens = {
            e.resolved_name: config.env_sampling(e).max_completion_tokens for e in config.env
        }
        self.log = get_logger(worker=self.worker, run=config.run.name, role="filter")
        self.bus: Bus | None = None
        self.streams: list[str] = []
        self._stop = asyncio.Event()
        self.groups = 0

    def request_stop(self) -> None:
        self._stop.set()

    async def setup(self) -> None:
        self.bus = await connect_bus(self.config, self.worker)
        self.streams = [self.bus.keys.rollouts(e.resolved_name) for e in self.config.env]
        for stream in self.streams:
            await self.bus.ensure_group(stream, GROUP_FILTER)
        if self.vocab_size is None:
            self.vocab_size = model_vocab_size(self.config.model.path)
        await self._check_collapse()
        self.log.info(
            "filter_ready",
            streams=self.streams,
            vocab_size=self.vocab_size,
            collapse_after=self.collapse_after,
        )

    async def run(self) -> None:
        last_reclaim = 0.0
        while not self._stop.is_set():
            entries: list[Entry] = []
            if time.monotonic() - last_reclaim > self.config.redis.claim_idle_ms / 1000:
                last_reclaim = time.monotonic()
                for stream in self.streams:
                    entries += await self.bus.reclaim(
                        stream, GROUP_FILTER, on_dead=release_inflight(self.bus.keys.state())
                    )
            if not entries:
                entries = await self.bus.read_group(
                    self.streams, GROUP_FILTER, count=16, block_ms=self.config.redis.block_ms
                )
            if entries:
                await self.process(entries)
                await self._check_collapse()
            await self.bus.trim_consumed_every(self.streams)
        self.log.info("filter_stopped", groups=self.groups)

    async def close(self) -> None:
        if self.bus is not None:
            await self.bus.close()

    async def process(self, entries: list[Entry]) -> None:
        """Advantages + filters for each entry, then one atomic commit of everything."""
        keys = self.bus.keys
        acks, outputs, counts = [], [], FilterCounts()
        dropped, dropped_groups, rewards, streak = 0, 0, [], _Streak()
        release = release_inflight(keys.state())
        for entry in entries:
            group = entry.message
            if not isinstance(group, RolloutGroup):
                await self.bus.dead_letter(
                    entry, reason=f"expected a rollout_group, got {group.KIND}", group=GROUP_FILTER
                )
                continue
            if group.eval_step is not None:
                acks.append((entry.stream, GROUP_FILTER, entry.id))
                self.log.warning("eval_group_skipped", stream=entry.stream, task_id=group.task_id)
                continue
            try:
                kept, group_counts = self.filter_group(group)
            except (ArithmeticError, LookupError, TypeError, ValueError) as e:  # this group's data, not the worker
                await self.bus.dead_letter(entry, reason=f"filter: {type(e).__name__}: {e}", group=GROUP_FILTER,
                                           extra=lambda pipe, entry=entry: release(entry, pipe))
                continue
            acks.append((entry.stream, GROUP_FILTER, entry.id))
            group_rewards = [s.reward for s in group.samples]
            rewards += group_rewards
            counts.add(group_counts)
            if group.mode == "rl" and len(group.samples) >= 2:
                streak.add(zero_variance(group_rewards))
            dropped += len(group.samples) - len(kept)
            if kept:
                outputs.append((keys.filtered(group.env), group.replace(samples=kept)))
            else:
                dropped_groups += 1
        if not acks:
            return
        values = counts.metrics("filter") | {
            "filter/groups": float(len(outputs)),
            "filter/samples": float(len(rewards)),
            "filter/groups_dropped": float(dropped_groups),
        }
        if rewards:
            values["filter/reward_mean"] = sum(rewards) / len(rewards)
        outputs.append((keys.metrics(), Metric(source="filter", values=values)))
        state = keys.state()

        def extra(pipe) -> None:
            if dropped:
                pipe.hincrby(state, INFLIGHT_FIELD, -dropped)
            streak.apply(pipe, state)

        try:
            await self.bus.commit(acks, outputs, extra=extra)
        except NotOwned as e:  # stalled past claim_idle_ms: another filter has these groups now
            self.log.warning("groups_abandoned", groups=len(acks), error=str(e))
            return
        self.groups += len(acks)
        self.log.info(
            "groups_filtered",
            groups=len(acks),
            forwarded=len(outputs) - 1,
            samples=len(rewards),
            dropped=dropped,
        )

    def filter_group(self, group: RolloutGroup) -> tuple[list, FilterCounts]:
        """Advantages (rl groups) then the pre-batch filters; returns the kept samples and the counts."""
        if group.mode == "rl":
            max_tokens = self.max_completion_tokens.get(group.env)
            advantage = self.advantages.get(group.env, self.config.filter.advantage)
            assign_advantages(group.samples, advantage, max_tokens)
        filters = active_filters(self.config.filter.pre_batch_filters, group.mode)
        return apply_filters(group.samples, filters, self.vocab_size)

    async def _check_collapse(self) -> None:
        streak = int(await self.bus.state_get(STREAK_FIELD) or 0)
        if streak < self.collapse_after:
            return
        message = collapse_message(streak, self.collapse_after)
        await self.bus.state_set(**{STOP_REASON_FIELD: message})
        await self.bus.publish(
            self.bus.keys.metrics(),
            Metric(
                source="filter",
                values={
                    "collapse/zero_variance_groups": float(streak),
                    "collapse/limit": float(self.collapse_after),
                },
            ),
        )
        self.log.error("model_collapse", streak=streak, collapse_after=self.collapse_after)
        raise CollapseError(message)


class _Streak:
    """How one commit moves the zero-variance streak: reset at the last varied group, then count."""

    def __init__(self) -> None:
        self.reset = False
        self.trailing = 0

    def add(self, is_zero: bool) -> None:
        if is_zero:
            self.trailing += 1
        else:
            self.reset, self.trailing = True, 0

    def apply(self, pipe, state: str) -> None:
        if self.reset:
            pipe.hset(state, STREAK_FIELD, self.trailing)
        elif self.trailing:
            pipe.hincrby(state, STREAK_FIELD, self.trailing)


def main(config: RlbusConfig, argv: list[str]) -> int:
    """``rlbus filter @ cfg.toml``: compute advantages and filter groups until stopped."""
    parser = argparse.ArgumentParser(prog="rlbus filter", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--consumer", default=None, help="consumer name in the group (default filter-HOST-PID)"
    )
    args = parser.parse_args(argv)
    try:
        return asyncio.run(run_worker(FilterWorker(config, worker=args.consumer)))
    except CollapseError as e:
        print(f"rlbus filter: {e}", file=sys.stderr)
        return COLLAPSE_EXIT_CODE
