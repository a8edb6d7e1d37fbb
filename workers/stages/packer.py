"""The packer worker: ``filtered:*`` → the micro-batches of step ``s`` in ``batches:{s}``.

Steps are built in order, ``s = packer:last_step + 1``, and only once ``s ≤ trained + 1 +
prefetch`` (``prefetch_steps`` capped at ``max_off_policy_steps``). A step takes whole groups:
``batch_size`` samples (and, with ``max_batch_size``, whatever more is queued, up to it), or up to
``token_batch_size`` tokens (the group that would overflow waits for the next step). Groups
whose start policy version is older than ``s − 1 − max_off_policy_steps`` are dropped as stale at
once (ack, a ``packer/stale_groups`` metric for step ``s`` and the in-flight release, one commit).
The post-batch filters run on the assembled batch, then :func:`workers.stages.packing.pack_step`.
When the feeder's data is exhausted (``feeder.max_epochs``) and every sample still in flight is
held here, the last partial step is built and the packer sets ``stop_reason = "data exhausted"``.

In flight: the packer ends the life of every group it consumes (packed, stale, or removed by the
post-batch filters), so its commits lower the feeder's ``inflight`` count by those groups'
samples: ``feeder.max_inflight_rollouts`` bounds everything between the feeder and the packer.
When that bound is reached and every in-flight sample is already held here (nothing more can
arrive), the packer builds the step from what it holds rather than wait forever.

Keep-alive: groups held while a batch fills or the prefetch gate is closed are XCLAIMed (JUSTID)
to this consumer every ``claim_idle_ms / 3``, so they never look idle to ``Bus.reclaim`` (which
would otherwise re-deliver them to this packer and dead-letter them after ``max_deliveries``
while they still get packed).

Exactly once: the groups a step uses stay pending in the ``packer`` group (under this packer's
stable consumer name) until the one commit that publishes every micro-batch of ``batches:{s}``,
acks every input it consumed (stale groups included) and sets ``packer:last_step = s``, guarded
on ``packer:last_step`` still being ``s − 1``. A packer killed before that commit wrote nothing;
restarted, it first re-reads its own pending entries (XREADGROUP from id 0), then new ones.
Run one packer per run (a second one only as a standby: the guard keeps steps unique).
"""

import argparse
import asyncio
import os
import time
from dataclasses import dataclass

import numpy as np

from bus.commit import CommitConflict, NotOwned
from bus.entries import Entry
from bus.errors import ConfigError
from bus.keys import GROUP_PACKER
from bus.lease import Lease, process_holder
from bus.log import get_logger
from bus.messages import Metric, RolloutGroup, Sample, task_position
from bus.policy import PolicyTracker
from bus.state import (
    DATA_EXHAUSTED,
    EXHAUSTED_EPOCHS_FIELD,
    FEEDER_DONE_FIELD,
    INFLIGHT_FIELD,
    LAST_STEP_FIELD,
    STOP_REASON_FIELD,
    reconcile_inflight,
    release_inflight,
)
from bus.streams import Bus
from workers.config import RlbusConfig
from workers.lifecycle import connect_bus, run_worker
from workers.stages.packing import pack_step
from workers.stages.sample_filters import FilterCounts, active_filters, apply_filters, model_vocab_size

RECONCILE_AT_END_S = 5.0
"""Once the data is exhausted, how often the packer recomputes the in-flight count while it waits for the rest (the
feeder, whose reconciler repairs a lost release otherwise, has exited)."""

PAUSE_ENV = "RLBUS_TEST_PAUSE_BEFORE_COMMIT_S"
"""Test hook: seconds to sleep between assembling a step and committing it (a window to kill -9 in)."""


@dataclass
class Held:
    """A group read from ``filtered:{env}`` and not yet committed (pending under this consumer)."""

    entry: Entry
    group: RolloutGroup
    tokens: int


class PackerWorker:
    """Builds each training step once, from whole groups, in order."""

    def __init__(self, config: RlbusConfig, worker: str = "packer-0", vocab_size: int | None = None):
        if not config.env:
            raise ConfigError("no [[env]] configured; the packer needs at least one env")
        self.config = config
        self.cfg = config.packer
        self.worker = worker
        self.vocab_size = vocab_size
        self.log = get_logger(worker=worker, run=config.run.name, role="packer")
        self.bus: Bus | None = None
        self.tracker: PolicyTracker | None = None
        self.streams: list[str] = []
        self.held: list[Held] = []
        self.stale: list[Held] = []
        self._ids: set[tuple[str, str]] = set()
        self._replay: dict[str, str] = {}
        self.stored: str | None = None
        self.max_inflight = config.max_inflight_rollouts()
        self.max_group_size = max(e.group_size for e in config.env)
        self._stop = asyncio.Event()
        self.active = False
        """True once this packer holds the lease (a standby until then)."""
        self.exhausted = False
        """The feeder issued its last task and every sample still in flight is held here."""
        self._reconciled_at = 0.0

    @property
    def last_step(self) -> int:
        return int(self.stored or 0)

    def request_stop(self) -> None:
        self._stop.set()

    async def setup(self) -> None:
        self.bus = await connect_bus(self.config, self.worker)
        self.tracker = PolicyTracker(self.bus)
        self.streams = [self.bus.keys.filtered(e.resolved_name) for e in self.config.env]
        for stream in self.streams:
            await self.bus.ensure_group(stream, GROUP_PACKER)
        if self.vocab_size is None:
            self.vocab_size = model_vocab_size(self.config.model.path)
        self.lease = Lease(self.bus, "packer", process_holder(self.worker), self.cfg.lease_ttl_s)
        self.log.info("packer_standby", hint="waiting for the packer lease; another packer holds it")
        if not await self.lease.acquire(self._stop):
            return
        self.active = True
        taken = sum([await self.bus.take_over(stream, GROUP_PACKER) for stream in self.streams])
        await self._restart_from_redis()
        self.log.info(
            "packer_ready", last_step=self.last_step, streams=self.streams, dp_size=self.config.trainer.nproc,
            pending_taken_over=taken,
        )

    async def _restart_from_redis(self) -> None:
        """Forget what is held; re-read ``packer:last_step`` and (next) this consumer's pending entries."""
        self.stored = await self.bus.state_get(LAST_STEP_FIELD)
        self.held, self.stale, self._ids = [], [], set()
        self._replay = {stream: "0" for stream in self.streams}

    async def close(self) -> None:
        if self.bus is not None:
            if self.active:
                await self.lease.release()
            await self.bus.close()

    async def run(self) -> None:
        if not self.active:
            return
        self._keep_alive = asyncio.create_task(self.bus.keep_claimed(GROUP_PACKER, lambda: self._ids))
        self._lease_kept = asyncio.create_task(self.lease.keep())
        try:
            await self._loop()
        finally:
            self._keep_alive.cancel()
            self._lease_kept.cancel()
        self.log.info("packer_stopped", last_step=self.last_step)

    async def _loop(self) -> None:
        max_steps = self.config.run.max_steps
        last_reclaim = time.monotonic()
        while not self._stop.is_set():
            for task in (self._keep_alive, self._lease_kept):
                if task.done():
                    task.result()  # it gave up: the held groups or the lease may be another packer's now
            await self.bus.trim_consumed_every(self.streams)
            step = self.last_step + 1
            if max_steps is not None and step > max_steps:
                self.log.info("packer_done", last_step=self.last_step)
                return
            if self.cfg.max_batch_size is not None and self._ready() and not self._replay:
                await self._read_queued()
            self._drop_stale(step)
            if self.stale:
                await self._release_stale(step)
                continue
            if not self._ready() and not await self._pipeline_full():
                reclaim = time.monotonic() - last_reclaim > self.config.redis.claim_idle_ms / 1000
                if reclaim:
                    last_reclaim = time.monotonic()
                await self._read(reclaim)
                continue
            if self.exhausted and not self.held:
                await self.bus.state_set(**{STOP_REASON_FIELD: DATA_EXHAUSTED,
                                            EXHAUSTED_EPOCHS_FIELD: self.config.feeder.max_epochs})
                self.log.info("packer_done", last_step=self.last_step, reason=DATA_EXHAUSTED)
                return
            if not await self._allowed(step):
                continue
            await self.build(step)

    # Reading.

    async def _read(self, reclaim: bool) -> None:
        """Own pending entries first (after a start or a conflict), then claimed and new ones."""
        release = release_inflight(self.bus.keys.state())
        if self._replay:
            for stream, after in list(self._replay.items()):
                entries, next_after = await self.bus.read_pending(stream, GROUP_PACKER, after, on_dead=release)
                if next_after is None:
                    del self._replay[stream]
                    continue
                self._replay[stream] = next_after
                await self._hold_all(entries)
            return
        entries: list[Entry] = []
        if reclaim:  # idle entries of a dead consumer; our own held ones are kept busy by Bus.keep_claimed
            for stream in self.streams:
                claimed = await self.bus.reclaim(stream, GROUP_PACKER, on_dead=release)
                entries += [e for e in claimed if (e.stream, e.id) not in self._ids]
        entries += await self.bus.read_group(
            self.streams, GROUP_PACKER, count=64, block_ms=self.config.redis.block_ms
        )
        await self._hold_all(entries)

    async def _read_queued(self) -> None:
        """A step has its minimum: also take what is queued right now (no waiting), for ``max_batch_size``."""
        await self._hold_all(await self.bus.read_group(self.streams, GROUP_PACKER, count=64, block_ms=None))

    async def _hold_all(self, entries: list[Entry]) -> None:
        """Hold each entry read, asking Redis once for all of their tasks' packed bits."""
        packed = await self._packed_bits([e.message for e in entries if isinstance(e.message, RolloutGroup)])
        for entry in entries:
            await self._hold(entry, packed)

    async def _packed_bits(self, groups: list[RolloutGroup]) -> dict[str, bool]:
        """Whether each group's task was packed or dropped as stale already (its bit in ``packed:{env}:{epoch}``),
        by task id; one pipeline for all."""
        positions = {g.task_id: p for g in groups if (p := task_position(g.task_id)) is not None}
        if not positions:
            return {}
        pipe = self.bus.redis.pipeline(transaction=False)
        for env, epoch, index in positions.values():
            pipe.getbit(self.bus.keys.packed(env, epoch), index)
        return dict(zip(positions, map(bool, await pipe.execute()), strict=True))

    async def _hold(self, entry: Entry, packed: dict[str, bool]) -> None:
        if (entry.stream, entry.id) in self._ids:
            return
        if not isinstance(entry.message, RolloutGroup):
            await self.bus.dead_letter(
                entry, reason=f"expected a rollout_group, got {entry.message.KIND}", group=GROUP_PACKER
            )
            return
        if self._consumed_before(entry.message, packed):
            await self._drop_duplicate(entry)
            return
        outside = out_of_vocabulary(entry.message, self.vocab_size)
        if outside is not None:
            release = release_inflight(self.bus.keys.state())
            await self.bus.dead_letter(entry, reason=f"token id {outside} is outside the vocabulary [0, "
                                       f"{self.vocab_size})", group=GROUP_PACKER, extra=lambda p: release(entry, p))
            return
        seq_len = self.cfg.seq_len
        tokens = sum(min(s.num_tokens, seq_len) for s in entry.message.samples)
        self._ids.add((entry.stream, entry.id))
        self.held.append(Held(entry, entry.message, tokens))

    # Assembling.

    def _drop_stale(self, step: int) -> None:
        """Move groups more than ``max_off_policy_steps`` versions behind policy ``step − 1`` to the stale list (sft
        groups never go stale: a teacher's or a reference's answer does not depend on the policy's version)."""
        oldest = step - 1 - self.cfg.max_off_policy_steps
        fresh = []
        for held in self.held:
            keep = held.group.mode == "sft" or held.group.policy_version >= oldest
            (fresh if keep else self.stale).append(held)
        self.held = fresh

    def _consumed_before(self, group: RolloutGroup, packed: dict[str, bool]) -> bool:
        """Whether a group of this task is held here or was packed or dropped as stale already (``packed``: from
        :meth:`_packed_bits`)."""
        return any(h.group.task_id == group.task_id for h in self.held + self.stale) or packed.get(group.task_id, False)

    async def _drop_duplicate(self, entry: Entry) -> None:
        """Ack a second group of one task, count it, release nothing (the feeder counted the task once)."""
        metric = Metric(source="packer", values={"packer/duplicate_groups": 1.0})
        try:
            await self.bus.commit([(entry.stream, GROUP_PACKER, entry.id)], [(self.bus.keys.metrics(), metric)])
        except NotOwned:
            return
        self.log.warning("duplicate_group_dropped", stream=entry.stream, entry_id=entry.id,
                         task_id=entry.message.task_id)

    def _mark_consumed(self, commands, groups: list["Held"]) -> None:
        """Set each training task's bit in its epoch's ``packed`` bitmap (inside the commit that consumes it)."""
        for held in groups:
            position = task_position(held.group.task_id)
            if position is not None:
                env, epoch, index = position
                commands.setbit(self.bus.keys.packed(env, epoch), index, 1)

    async def _release_stale(self, step: int) -> None:
        """Ack the stale groups, report them for ``step`` and release their in-flight samples, in one commit."""
        stale = self.stale
        samples = _samples(stale)
        acks = [(h.entry.stream, GROUP_PACKER, h.entry.id) for h in stale]
        metric = Metric(source="packer", step=step, values={"packer/stale_groups": float(len(stale))})
        state = self.bus.keys.state()
        def extra(commands) -> None:
            commands.hincrby(state, INFLIGHT_FIELD, -samples)
            self._mark_consumed(commands, stale)

        try:
            await self.bus.commit(acks, [(self.bus.keys.metrics(), metric)], extra=extra)
        except NotOwned as e:
            self.log.warning("packer_input_lost", step=step, error=str(e), hint="re-reading what is still ours")
            await self._restart_from_redis()
            return
        self.stale = []
        self._ids -= {(h.entry.stream, h.entry.id) for h in stale}
        self.log.info("stale_groups_dropped", step=step, groups=len(stale), samples=samples)

    async def _pipeline_full(self) -> bool:
        """True when no more groups can come before the next step: every in-flight sample is held here, and the
        feeder cannot issue another group (the in-flight cap) or never will (its data is exhausted)."""
        if self._replay:
            return False
        held = _samples(self.held)
        inflight, done = await self.bus.redis.hmget(self.bus.keys.state(), [INFLIGHT_FIELD, FEEDER_DONE_FIELD])
        inflight = int(inflight or 0)
        epochs = self.config.feeder.max_epochs
        done = epochs is not None and done is not None and done.decode() == str(epochs)
        if inflight > held and done and time.monotonic() - self._reconciled_at > RECONCILE_AT_END_S:
            self._reconciled_at = time.monotonic()  # a release lost near the end would otherwise wait forever
            _, inflight = await reconcile_inflight(self.bus, [e.resolved_name for e in self.config.env])
        if inflight > held:
            return False
        self.exhausted = done
        return self.exhausted or (held > 0 and inflight + self.max_group_size > self.max_inflight)

    def _ready(self) -> bool:
        if self.cfg.token_batch_size is not None:
            return sum(h.tokens for h in self.held) >= self.cfg.token_batch_size
        return _samples(self.held) >= self.config.batch_size()

    def _take(self) -> list[Held]:
        """The groups of the next step, in read order (whole groups)."""
        taken, samples, tokens = [], 0, 0
        for held in self.held:
            if self.cfg.token_batch_size is not None:
                if taken and tokens + held.tokens > self.cfg.token_batch_size:
                    break
            elif samples >= (self.cfg.max_batch_size or self.config.batch_size()):
                break
            taken.append(held)
            samples += len(held.group.samples)
            tokens += held.tokens
        return taken

    async def _allowed(self, step: int) -> bool:
        """Wait (up to block_ms) until ``step ≤ trained + 1 + prefetch``."""
        limit = 1 + self.cfg.prefetch
        try:
            await self.tracker.wait(
                lambda t: step <= t.trained + limit, timeout_s=self.config.redis.block_ms / 1000
            )
        except TimeoutError:
            return False
        return True

    async def build(self, step: int) -> None:
        """Assemble, filter, pack and commit step ``step``."""
        if not self._ready():
            self.log.info("partial_step", step=step, samples=_samples(self.held), max_inflight=self.max_inflight,
                          hint="the data is exhausted" if self.exhausted else
                          "feeder.max_inflight_rollouts is reached and every in-flight sample is here")
        taken = self._take()
        samples, rewards, counts = self._filter(taken)
        batches, stats = pack_step(samples, step=step, seq_len=self.cfg.seq_len, dp_size=self.config.trainer.nproc,
                                   share_prompts=self.cfg.share_prompts)
        values = counts.metrics("packer/filter") | {
            "packer/groups": float(len(taken)),
            "packer/samples": float(stats.samples),
            "packer/tokens": float(stats.tokens),
            "packer/loss_tokens": float(stats.loss_tokens),
            "packer/truncated": float(stats.truncated),
            "packer/micro_batches": float(stats.micro_batches),
            "packer/padding_micro_batches": float(stats.padding_micro_batches),
            "packer/efficiency": stats.efficiency,
            "packer/reward_mean": _mean(rewards),
            "packer/steps_off_policy": _mean([step - 1 - s.policy_version_start for s in samples]),
        }
        outputs = [(self.bus.keys.batches(step), mb) for mb in batches]
        outputs.append((self.bus.keys.metrics(), Metric(source="packer", step=step, values=values)))
        acks = [(h.entry.stream, GROUP_PACKER, h.entry.id) for h in taken]
        released = _samples(taken)
        if os.environ.get(PAUSE_ENV):
            self.log.warning("packer_commit_paused", step=step, pause_s=float(os.environ[PAUSE_ENV]))
            await asyncio.sleep(float(os.environ[PAUSE_ENV]))
        if not await self._commit(step, acks, outputs, released, taken):
            return
        self.held = self.held[len(taken) :]
        self._ids -= {(h.entry.stream, h.entry.id) for h in taken}
        self.log.info(
            "batch_packed",
            step=step,
            samples=stats.samples,
            tokens=stats.tokens,
            micro_batches=stats.micro_batches,
            efficiency=round(stats.efficiency, 4),
            truncated=stats.truncated,
        )

    def _filter(self, taken: list[Held]) -> tuple[list[Sample], list[float], FilterCounts]:
        """The post-batch filters over the taken groups: kept samples, every reward, the counts."""
        samples, rewards, counts = [], [], FilterCounts()
        for held in taken:
            group = held.group
            rewards += [s.reward for s in group.samples]
            filters = active_filters(self.cfg.post_batch_filters, group.mode)
            kept, group_counts = apply_filters(group.samples, filters, self.vocab_size)
            counts.add(group_counts)
            samples += kept
        return samples, rewards, counts

    async def _commit(self, step: int, acks: list, outputs: list, released: int, taken: list["Held"]) -> bool:
        """The guarded commit (``released``: in-flight samples it ends); False when another packer built the step."""
        state = self.bus.keys.state()
        expected = self.stored

        def extra(pipe) -> None:
            pipe.hset(state, LAST_STEP_FIELD, step)
            pipe.hincrby(state, INFLIGHT_FIELD, -released)
            self._mark_consumed(pipe, taken)

        try:
            await self.bus.commit(acks, outputs, extra=extra, guard=(state, LAST_STEP_FIELD, expected))
        except NotOwned as e:
            self.log.warning("packer_input_lost", step=step, error=str(e), hint="re-reading what is still ours")
        except CommitConflict:
            self.log.warning("packer_step_taken", step=step, hint="another packer built this step; re-reading")
        else:
            self.stored = str(step)
            return True
        await self._restart_from_redis()
        return False


def _samples(held: list[Held]) -> int:
    """How many samples the held groups carry."""
    return sum(len(h.group.samples) for h in held)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def main(config: RlbusConfig, argv: list[str]) -> int:
    """``rlbus packer @ cfg.toml``: build steps 1, 2, … until stopped (or run.max_steps)."""
    parser = argparse.ArgumentParser(prog="rlbus packer", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--consumer",
        default="packer-0",
        help="stable consumer name: a restarted packer re-reads its own pending entries (default packer-0)",
    )
    args = parser.parse_args(argv)
    return asyncio.run(run_worker(PackerWorker(config, worker=args.consumer)))


def out_of_vocabulary(group: RolloutGroup, vocab_size: int) -> int | None:
    """A token id of the group outside ``[0, vocab_size)`` (the first found), or None when every id is inside.

    One pass per array: as uint32 a negative id is ≥ 2**31, so a single max catches both ends.
    """
    for sample in group.samples:
        for ids in (sample.prompt_ids, sample.completion_ids):
            if len(ids) and int(ids.view(np.uint32).max()) >= vocab_size:
                bad = ids[(ids < 0) | (ids >= vocab_size)]
                return int(bad[0])
    return None
