"""The feeder: datasets → one task per example in ``tasks:{env}``.

- Env mixing: envs take turns by weight: the next task goes to the env furthest behind its share
  (largest ``(issued_all + 1) × share − issued``), weight = ``ratio`` when set, else the dataset
  size (so every example is equally likely, prime-rl's default). Each env's count stays within
  one task of its share, and the order follows from the cursors alone, so it survives restarts.
- Each epoch visits every example once, in an order shuffled with ``(run.seed, env, epoch)``.
- In flight: the state hash field ``inflight`` counts samples issued and not yet consumed by the
  packer, so the cap bounds everything between feeder and packer (tasks, rollouts, groups waiting
  in ``filtered:*``). The feeder adds ``group_size`` in the same MULTI as the XADD; the packer
  subtracts the samples of every group it consumes (packed, stale, post-batch filtered), the
  filter the samples its enforced pre-batch filters drop, and a dead-lettered training task or
  group gives its samples back in its dead-letter commit (the rollout worker's own, and
  ``Bus.reclaim`` with the :func:`bus.state.release_inflight` hook). Eval tasks never count. The feeder
  issues tasks only while ``inflight + group_size ≤ max_inflight_rollouts`` (as many as fit, up to ``ISSUE_BATCH``
  of one env in one commit); otherwise it blocks (XREAD BLOCK) on the streams written in the same MULTI as each
  decrement: ``metrics`` (every filter and packer commit writes one) and ``dead``, re-reading the count only
  after an entry that may come with a release (not the rollout worker's, trainer's or eval's metrics).
- Cursor: ``feeder:cursor:{env}`` / ``feeder:epoch:{env}`` in the state hash move in the same
  MULTI as the XADD, guarded (WATCH) on the cursor, so a restarted feeder continues exactly where
  it stopped and a second feeder on the same run cannot issue the same position twice.
"""

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field

from bus.commit import CommitConflict
from bus.errors import ConfigError
from bus.log import get_logger
from bus.messages import Metric, Task, training_task_id
from bus.resp import as_str
from bus.state import (
    FEEDER_DONE_FIELD,
    INFLIGHT_FIELD,
    RUN_EPOCH_FIELD,
    cursor_field,
    epoch_field,
    reconcile_inflight,
)
from bus.streams import Bus
from workers.config import RlbusConfig
from workers.envs.connect import start_env
from workers.lifecycle import connect_bus, consumer_name, run_worker

ISSUE_BATCH = 64
"""Most tasks one commit issues (a step's worth of one-sample SFT groups in two commits)."""

NEVER_RELEASE = frozenset({b"rollout", b"trainer", b"eval", b"inference"})
"""``source`` of the metrics entries that never come with a release (the rollout worker's one per group, say): the
feeder blocks on past them without re-reading the count. Any other entry (a dead letter has no ``source``) wakes it."""
WAKE_READ_COUNT = 1000
"""Entries one wake reads past (all that came since the last, normally: only the newest id is kept)."""
RECONCILE_INTERVAL_S = 30.0
"""How often the feeder recomputes the in-flight count from the streams (:func:`bus.state.reconcile_inflight`)."""


def epoch_order(size: int, seed: int, env: str, epoch: int, shuffle: bool = True) -> list[int]:
    """Example indices of one epoch: a permutation of ``range(size)`` fixed by (seed, env, epoch)."""
    order = list(range(size))
    if shuffle:
        random.Random(f"{seed}:{env}:{epoch}").shuffle(order)
    return order


@dataclass
class EnvCursor:
    """Where the feeder stands in one env's dataset."""

    name: str
    size: int
    weight: float
    group_size: int
    mode: str
    epoch: int = 0
    position: int = 0
    stored: str | None = None
    """The cursor value last read from / written to Redis (the commit guard)."""
    _order: tuple[int, list[int]] | None = field(default=None, repr=False)
    """(epoch, that epoch's example order), computed once per epoch."""

    @property
    def issued(self) -> int:
        return self.epoch * self.size + self.position

    def example_index(self, seed: int, shuffle: bool) -> int:
        """The example at the current position of the current epoch."""
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, epoch_order(self.size, seed, self.name, self.epoch, shuffle))
        return self._order[1][self.position]

    def advance(self) -> tuple[int, int]:
        """(position, epoch) after issuing the current position."""
        if self.position + 1 < self.size:
            return self.position + 1, self.epoch
        return 0, self.epoch + 1


def pick_env(cursors: list[EnvCursor], max_epochs: int | None = None) -> EnvCursor | None:
    """The env furthest behind its share after one more task; None when every env finished max_epochs."""
    live = [c for c in cursors if max_epochs is None or c.epoch < max_epochs]
    if not live:
        return None
    total_weight = sum(c.weight for c in live)
    next_total = sum(c.issued for c in live) + 1
    return max(live, key=lambda c: next_total * c.weight / total_weight - c.issued)


class FeederWorker:
    """Issues tasks for every [[env]] while the in-flight count leaves room."""

    def __init__(self, config: RlbusConfig, sizes: dict[str, int] | None = None, worker: str | None = None):
        if not config.env:
            raise ConfigError("no [[env]] configured; the feeder needs at least one env")
        self.config = config
        self.sizes = sizes
        self.worker = consumer_name("feeder", worker)
        self.max_inflight = config.max_inflight_rollouts()
        self.log = get_logger(worker=self.worker, run=config.run.name, role="feeder")
        self.bus: Bus | None = None
        self.cursors: list[EnvCursor] = []
        self._reconciled_at = 0.0
        self._wake_ids: dict[str, str] | None = None
        """Last entry seen of each stream a release writes to (``metrics``, ``dead``): where the next wait blocks."""
        self.issued = 0
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def setup(self) -> None:
        self.bus = await connect_bus(self.config, self.worker)
        sizes = self.sizes if self.sizes is not None else await self._dataset_sizes()
        for env in self.config.env:
            name = env.resolved_name
            if sizes.get(name, 0) < 1:
                raise ConfigError(f"env {name!r} reports a dataset of {sizes.get(name)} examples; it needs at least 1")
            weight = env.ratio if env.ratio is not None else float(sizes[name])
            self.cursors.append(EnvCursor(name, sizes[name], weight, env.group_size, env.mode))
        if self.config.ckpt.resume_step is not None:
            await self._wait_for_the_trainer()
        await self._load_cursors()
        self.log.info("feeder_ready", max_inflight=self.max_inflight,
                      envs={c.name: f"epoch {c.epoch} position {c.position}/{c.size}" for c in self.cursors})

    async def _wait_for_the_trainer(self) -> None:
        """A run that may resume from a checkpoint is opened by its trainer (which may first restore the data
        position into an empty Redis): wait for the run epoch it writes before reading the cursors."""
        while not self._stop.is_set() and await self.bus.state_get(RUN_EPOCH_FIELD) is None:
            self.log.info("feeder_waiting_for_trainer", hint="the trainer opens a resumable run (ckpt.resume_step)")
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=1.0)
            except TimeoutError:
                pass

    async def _dataset_sizes(self) -> dict[str, int]:
        """Each env server's dataset size (spawning the servers that have no address)."""
        sizes = {}
        for env in self.config.env:
            handle = await start_env(env, self.config.rollout.env_timeout_s, serve=False,
                                   curve_dir=self.config.rollout.curve_dir)
            try:
                sizes[env.resolved_name] = int((await handle.info())["size"])
            finally:
                await handle.close()
        return sizes

    async def _load_cursors(self) -> None:
        fields = [f for c in self.cursors for f in (cursor_field(c.name), epoch_field(c.name))]
        values = await self.bus.redis.hmget(self.bus.keys.state(), fields)
        for i, c in enumerate(self.cursors):
            raw_cursor, raw_epoch = values[2 * i], values[2 * i + 1]
            c.stored = as_str(raw_cursor) if raw_cursor is not None else None
            c.position = int(raw_cursor) if raw_cursor is not None else 0
            c.epoch = int(raw_epoch) if raw_epoch is not None else 0
            if c.position >= c.size:
                raise ConfigError(
                    f"feeder cursor {c.position} of env {c.name!r} is past its dataset ({c.size} examples); the "
                    f"dataset shrank since this run started: use a new run.name or delete {cursor_field(c.name)}"
                )

    async def run(self) -> None:
        max_epochs = self.config.feeder.max_epochs
        while not self._stop.is_set():
            await self._reconcile()
            cursor = pick_env(self.cursors, max_epochs)
            if cursor is None:
                await self.bus.state_set(**{FEEDER_DONE_FIELD: max_epochs})
                self.log.info("feeder_done", epochs=max_epochs, issued=self.issued)
                return
            room = await self._wait_for_room(cursor.group_size)
            if room:
                await self._issue(cursor, room, max_epochs)
        self.log.info("feeder_stopped", issued=self.issued)

    async def _reconcile(self) -> None:
        """Every ``RECONCILE_INTERVAL_S``: recompute the in-flight count from the streams; report and fix drift."""
        if time.monotonic() - self._reconciled_at < RECONCILE_INTERVAL_S:
            return
        self._reconciled_at = time.monotonic()
        was, now = await reconcile_inflight(self.bus, [c.name for c in self.cursors])
        if was != now:
            self.log.warning("inflight_reconciled", was=was, now=now,
                             hint="a release was lost (an entry that could not be decoded, say); corrected")
            await self.bus.publish(self.bus.keys.metrics(),
                                   Metric(source="feeder", values={"feeder/inflight_drift": float(now - was)}))

    async def _wait_for_room(self, group_size: int) -> int:
        """The samples that fit in flight, once ``group_size`` more do; else block until a release may have come (or
        the block times out: re-check stop) and return 0.

        A release writes its ``metrics`` or ``dead`` entry in the MULTI of its decrement, so blocking after the
        last entry seen before reading the count misses none. The first call finds the streams' last entries."""
        keys = self.bus.keys
        if self._wake_ids is None:
            self._wake_ids = {stream: await self.bus.last_id(stream) for stream in (keys.metrics(), keys.dead())}
        inflight = await self.bus.redis.hget(keys.state(), INFLIGHT_FIELD)
        room = self.max_inflight - int(inflight or 0)
        if room >= group_size:
            return room
        while not self._stop.is_set():
            woken = await self.bus.read_headers(self._wake_ids, WAKE_READ_COUNT, self.config.redis.block_ms)
            if not woken:
                break
            for stream, entry_id, _ in woken:
                self._wake_ids[stream] = entry_id
            if any(fields.get(b"source") not in NEVER_RELEASE for _, _, fields in woken):
                break
        return 0

    async def _issue(self, c: EnvCursor, room: int, max_epochs: int | None) -> None:
        """Issue env ``c``'s next tasks in one commit: as many as fit in ``room`` samples (at most ``ISSUE_BATCH``)
        while ``c`` stays the env :func:`pick_env` picks. The cursor moves in memory as each task is planned and
        goes back if the commit does not go through."""
        before = c.position, c.epoch
        tasks = []
        while len(tasks) < ISSUE_BATCH and room >= c.group_size and pick_env(self.cursors, max_epochs) is c:
            index = c.example_index(self.config.run.seed, self.config.feeder.shuffle)
            tasks.append(Task(task_id=training_task_id(c.name, c.epoch, c.position), env=c.name, example_index=index,
                              example_id=str(index), epoch=c.epoch, group_size=c.group_size, mode=c.mode))
            c.position, c.epoch = c.advance()
            room -= c.group_size
        state = self.bus.keys.state()

        def extra(pipe) -> None:
            pipe.hset(state, mapping={cursor_field(c.name): c.position, epoch_field(c.name): c.epoch})
            pipe.hincrby(state, INFLIGHT_FIELD, c.group_size * len(tasks))

        try:
            await self.bus.commit([], [(self.bus.keys.tasks(c.name), task) for task in tasks], extra=extra,
                                  guard=(state, cursor_field(c.name), c.stored))
        except CommitConflict:
            self.log.warning("feeder_cursor_moved", env=c.name, expected=c.stored,
                             hint="another feeder runs on this run; reloading the cursor")
            await self._load_cursors()
            return
        except BaseException:
            c.position, c.epoch = before
            raise
        c.stored = str(c.position)
        self.issued += len(tasks)
        for epoch in range(before[1], c.epoch):
            self.log.info("epoch_finished", env=c.name, epoch=epoch, size=c.size)

    async def close(self) -> None:
        if self.bus is not None:
            await self.bus.close()


def main(config: RlbusConfig, argv: list[str]) -> int:
    """``rlbus feeder @ cfg.toml``: issue tasks until stopped (or feeder.max_epochs are done)."""
    parser = argparse.ArgumentParser(prog="rlbus feeder", description=__doc__.splitlines()[0])
    parser.add_argument("--consumer", default=None, help="worker name in logs (default feeder-HOST-PID)")
    args = parser.parse_args(argv)
    return asyncio.run(run_worker(FeederWorker(config, worker=args.consumer)))
