"""The trainer's tenure: one trainer (one data-parallel group) trains a run at a time; others wait as standbys.

Rank 0 holds ``lease:trainer`` (renewed from a thread, so a long step or checkpoint save never looks like a dead
trainer, but only while the loop calls :meth:`TrainerTenure.check` within ``trainer.progress_timeout_s``, so a
wedged one lets it lapse); the other ranks of its group wait until their rank 0 holds it. A standby loads its
model, then waits; when the holder dies its lease expires and the standby resumes from the newest checkpoint, as a
restarted trainer would. Every publication of the holder (weights events, ``trained``) is a commit guarded on the
state field :data:`bus.state.TRAINER_FIELD` (``{holder}@{step}``) it last wrote, which makes two things refuse the
write:

- another trainer took over meanwhile (this one was stalled past the lease): the field names someone else;
- Redis went back to an older copy of the run (a restored snapshot, writes lost with a host): its step is behind.

A trainer that starts from a checkpoint newer than the step Redis holds stops with a config error, since Redis's
data positions (feeder cursors, consumed tasks) are older than the weights and would be trained again.
"""

import asyncio
import os
import socket
import uuid

from bus.codec import Message
from bus.commit import CommitConflict
from bus.config import redis_password
from bus.errors import ConfigError, RlbusError
from bus.lease import Lease, LeaseKeeper, LeaseLost
from bus.resp import as_str
from bus.state import TRAINER_FIELD
from bus.streams import Bus
from trainer.dist import DistContext, broadcast_object
from workers.config import RlbusConfig

_POLL_S = 0.5
"""How often a rank other than 0 looks whether its rank 0 holds the lease yet."""


def holder_id(ctx: DistContext) -> str:
    """One id per trainer group, unique across hosts and restarts: rank 0's host, pid and a random part, sent to
    every rank of its group (two groups may well share a rendezvous address such as torchrun's default)."""
    return broadcast_object(f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}", ctx)


class TrainerTenure:
    """This trainer group's claim on the run: wait for the lease, check Redis against the checkpoint, publish
    only while still the holder."""

    def __init__(self, bus: Bus, config: RlbusConfig, ctx: DistContext):
        self.bus, self.config, self.ctx = bus, config, ctx
        self.holder = holder_id(ctx)
        self.lease = Lease(bus, "trainer", self.holder, config.trainer.lease_ttl_s)
        self.keeper: LeaseKeeper | None = None
        self.published: int | None = None
        """The last step this trainer wrote into :data:`TRAINER_FIELD`."""

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait as a standby until this group holds the trainer lease; False when ``stop`` is set first."""
        if self.ctx.is_main:
            if not await self.lease.acquire(stop):
                return False
            self.keeper = self.lease.keep_in_thread(self.config.redis.url, redis_password(self.config.redis),
                                                    self.config.trainer.progress_timeout_s)
            return True
        while not stop.is_set():
            if as_str(await self.bus.redis.get(self.lease.key) or b"") == self.holder:
                return True
            try:
                await asyncio.wait_for(stop.wait(), timeout=_POLL_S)
            except TimeoutError:
                pass
        return False

    async def claim(self, step: int) -> None:
        """Rank 0, once the checkpoint of ``step`` (0: none) is loaded: stop if Redis is behind it, else mark this
        trainer as the one publishing from ``step``."""
        if not self.ctx.is_main:
            return
        current = await self.bus.state_get(TRAINER_FIELD)
        last = _step_of(current)
        if last is not None and last < step:
            raise ConfigError(
                f"Redis says the trainer last published step {last}, but checkpoint step_{step} is newer: Redis went "
                f"back to an older copy of run {self.config.run.name!r} (a restored snapshot, or writes lost with its "
                f"host), and its tasks after step {last} would be trained twice. Restore Redis's newest data, or "
                f"resume from a checkpoint at or before step {last} (ckpt.resume_step = N)"
            )
        await self.bus.state_set(**{TRAINER_FIELD: f"{self.holder}@{step}"})
        self.published = step

    def check(self) -> None:
        """Mark progress (the lease is renewed only while this is called within ``trainer.progress_timeout_s``);
        raise :class:`LeaseLost` once the lease is lost (rank 0; other ranks follow their rank 0)."""
        if self.keeper is not None:
            self.keeper.progress()
            self.keeper.check()

    async def publish(self, outputs: list[tuple[str, Message]], step: int | None = None) -> list[str]:
        """XADD ``outputs`` only while this trainer is the holder and Redis is where it left it; with ``step``,
        also record that step as published."""
        self.check()
        state = self.bus.keys.state()
        expected = f"{self.holder}@{self.published}"

        def advance(commands) -> None:
            commands.hset(state, TRAINER_FIELD, f"{self.holder}@{step}")

        try:
            ids = await self.bus.commit([], outputs, guard=(state, TRAINER_FIELD, expected),
                                        extra=advance if step is not None else None)
        except CommitConflict:
            raise self._refused(await self.bus.state_get(TRAINER_FIELD)) from None
        if step is not None:
            self.published = step
        return ids

    def _refused(self, current: str | None) -> RlbusError:
        if current is None:
            return RlbusError(f"Redis no longer holds the trainer's state ({TRAINER_FIELD} is gone): it was wiped or "
                              "replaced; not publishing. The restarted trainer checks the run epoch")
        holder = current.rpartition("@")[0]
        if holder != self.holder:
            return LeaseLost(f"trainer {holder} took over (Redis: {TRAINER_FIELD}={current}) while this one was "
                             "stalled past trainer.lease_ttl_s; stopping without publishing")
        return RlbusError(f"Redis went back from step {self.published} to {_step_of(current)}: it was restored "
                          "from an older copy or lost writes; not publishing. The restarted trainer resumes from its "
                          "newest checkpoint if Redis is not behind it")

    async def close(self) -> None:
        """A clean stop gives the lease up at once, so a standby need not wait for the TTL."""
        if self.keeper is not None:
            self.keeper.close()
            self.keeper = None
            await self.lease.release()


def _step_of(value: str | None) -> int | None:
    if value is None:
        return None
    step = value.rpartition("@")[2]
    return int(step) if step.isdigit() else None
