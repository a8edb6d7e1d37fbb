"""Follow the ``weights`` stream: apply each newer update, then publish ``served``.

Shared by the built-in server and the vLLM launcher; they differ only in ``apply``. At startup the
newest event is applied if it is a safetensors update newer than the loaded weights (a finished
nccl/gloo broadcast cannot be joined late), then ``served`` is published once. While running,
every nccl event is joined in order (the trainer waits for all receivers); runs of whole-weights safetensors
events collapse to the newest, while every LoRA adapter event is loaded (vLLM serves the versions in flight side by
side; at startup the newest ``keep_adapters`` are loaded).

Eval hold: while the run's state field ``eval:hold`` (:data:`bus.state.EVAL_HOLD_FIELD`) is set,
no safetensors update with ``step > hold`` is served: the follower stops reading at the first such
event (``last_id`` stays before it) and re-checks the hold every :data:`HOLD_RECHECK_S`, so the eval
of step ``hold`` runs on exactly that version and the next one is served as soon as the hold moves on.
nccl events are never held (the trainer waits on the broadcast).
"""

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from bus.log import get_logger
from bus.messages import WeightUpdate
from bus.policy import HEARTBEAT_S, heartbeat, publish_served
from bus.state import EVAL_HOLD_FIELD
from bus.streams import Bus
from bus.weight_files import check_update

HOLD_RECHECK_S = 0.05
"""How often a held follower reads the eval hold again (one HGET; only while an eval is pending)."""
RECHECK_S = 0.5
"""How often an incomplete weights directory is checked again while ``ckpt.wait_for_weights_timeout`` runs."""

Apply = Callable[[WeightUpdate], Awaitable[None]]
"""Loads one update into the served model (returns once requests see the new weights)."""


class WeightsFollower:
    """Reads ``weights`` (fan-out, no group) and keeps ``served`` on ``policy`` up to date."""

    def __init__(self, bus: Bus, server_id: str, apply: Apply, weights_root: Path | str, step: int = 0,
                 block_ms: int = 1000, wait_for_weights_s: float | None = None, keep_adapters: int = 1):
        self.bus = bus
        self.server_id = server_id
        self.apply = apply
        self.step = step
        """Step of the weights being served."""
        self.block_ms = block_ms
        self.weights_root = Path(weights_root)
        """Only safetensors directories under this root whose files match their event are loaded."""
        self.wait_for_weights_s = wait_for_weights_s
        """How long an incomplete directory is waited for (``ckpt.wait_for_weights_timeout``); None: not at all."""
        self.keep_adapters = keep_adapters
        """LoRA: at startup, load this many of the newest adapter versions (vLLM serves them side by side)."""
        self.last_id = "0"
        self.failed_loads = 0
        """Updates that failed to load (the last good weights kept serving)."""
        self.log = get_logger(worker="inference", server=server_id, run=bus.keys.run)

    async def start(self) -> None:
        """Catch up with the newest event not held back (if loadable) and publish ``served`` once."""
        newest = await self._newest_unheld(await self._hold())
        if newest is not None:
            self.last_id, event = newest
            if isinstance(event, WeightUpdate) and event.step > self.step:
                if event.adapter is not None:
                    for older in await self._adapters_before(self.last_id, event.step):
                        await self._load(older)
                if event.format == "safetensors":
                    await self._load(event)
                else:
                    self.log.warning("weights_broadcast_missed", step=event.step,
                                     reason="started after the broadcast; waiting for the next update")
        await publish_served(self.bus, self.server_id, self.step)
        self.log.info("served_published", step=self.step)

    async def run(self) -> None:
        """Follow the stream until cancelled, renewing this server's heartbeat every ``HEARTBEAT_S``."""
        loop = asyncio.get_running_loop()
        beat = loop.time()
        while True:
            if loop.time() - beat >= HEARTBEAT_S:
                await heartbeat(self.bus, self.server_id)
                beat = loop.time()
            entries = await self.bus.read_fanout(self.bus.keys.weights(), self.last_id, block_ms=self.block_ms)
            if not entries:
                continue
            hold = await self._hold()
            events = []
            for entry_id, message in entries:
                if isinstance(message, WeightUpdate):
                    if _held(message, hold):
                        break
                    events.append(message)
                self.last_id = entry_id
            for event in _collapse(events):
                if event.step <= self.step and event.format == "safetensors":
                    continue
                if await self._load(event):
                    await publish_served(self.bus, self.server_id, self.step)
            if len(events) < sum(isinstance(m, WeightUpdate) for _, m in entries):
                # Held: XREAD BLOCK returns at once while the held event is unread, so wait here instead.
                self.log.debug("weights_held", hold=hold, served=self.step)
                await asyncio.sleep(HOLD_RECHECK_S)

    async def _adapters_before(self, entry_id: str, step: int) -> list[WeightUpdate]:
        """Up to ``keep_adapters - 1`` adapter events older than ``step``, at or before ``entry_id``, oldest first."""
        if self.keep_adapters <= 1:
            return []
        rows = await self.bus.read_range(self.bus.keys.weights(), high=entry_id, count=4 * self.keep_adapters,
                                         newest_first=True)
        found: list[WeightUpdate] = []
        for _, message in rows:
            if isinstance(message, WeightUpdate) and message.adapter is not None and self.step < message.step < step:
                found.append(message)
            if len(found) == self.keep_adapters - 1:
                break
        return found[::-1]

    async def _hold(self) -> int | None:
        value = await self.bus.state_get(EVAL_HOLD_FIELD)
        return None if value is None else int(value)

    async def _newest_unheld(self, hold: int | None) -> tuple[str, object] | None:
        """The newest ``weights`` entry before the first held one (None: none, or the oldest is held)."""
        stream = self.bus.keys.weights()
        if hold is None:
            return await self.bus.last(stream)
        newest = None
        for entry_id, message in await self.bus.read_range(stream):
            if isinstance(message, WeightUpdate) and _held(message, hold):
                break
            newest = (entry_id, message)
        return newest

    async def _load(self, event: WeightUpdate) -> bool:
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            if event.format == "safetensors":
                await self._check(event)
            await self.apply(event)
        except Exception as e:  # the one boundary of a load: keep serving the last good weights
            if event.format != "safetensors" and not isinstance(e, FileNotFoundError | ValueError):
                raise  # a broadcast that broke midway leaves its collective unusable: a fresh process rejoins
            # A pruned, mismatched or unreadable directory: the next update replaces it.
            self.failed_loads += 1
            self.log.error("weights_load_failed", step=event.step, format=event.format, dir=event.dir,
                           error=f"{type(e).__name__}: {e}", serving=self.step, failed_loads=self.failed_loads)
            return False
        self.step = event.step
        self.log.info("weights_loaded", step=event.step, format=event.format,
                      dir=event.dir and Path(event.dir).name, load_s=round(loop.time() - start, 3))
        return True


    async def _check(self, event: WeightUpdate) -> None:
        """The event's files are there and match; an incomplete directory is re-checked every
        :data:`RECHECK_S` for up to ``wait_for_weights_s``."""
        deadline = asyncio.get_running_loop().time() + (self.wait_for_weights_s or 0)
        while True:
            try:
                await asyncio.to_thread(check_update, event, self.weights_root)
                return
            except (FileNotFoundError, ValueError) as e:
                if asyncio.get_running_loop().time() >= deadline:
                    raise
                self.log.info("weights_waiting", step=event.step, dir=event.dir, error=str(e),
                              hint="ckpt.wait_for_weights_timeout: the directory may still be being written")
                await heartbeat(self.bus, self.server_id)  # still alive (and still serving the older weights)
                await asyncio.sleep(RECHECK_S)


def _held(event: WeightUpdate, hold: int | None) -> bool:
    """A safetensors update newer than the eval hold waits; nccl broadcasts never do."""
    return hold is not None and event.format == "safetensors" and event.step > hold


def _whole(event: WeightUpdate) -> bool:
    """A safetensors update of whole weights (a newer one makes it useless)."""
    return event.format == "safetensors" and event.adapter is None


def _collapse(events: list[WeightUpdate]) -> list[WeightUpdate]:
    """Keep every nccl and LoRA adapter event (a server serving adapters side by side needs every version); of
    consecutive whole-weights safetensors events keep only the newest."""
    out: list[WeightUpdate] = []
    for event in events:
        if out and _whole(event) and _whole(out[-1]):
            out[-1] = event
        else:
            out.append(event)
    return out
