"""Follow the ``weights`` stream: apply each newer update, then publish ``served``.

Shared by the built-in server and the vLLM launcher; they differ only in ``apply``. At startup the
newest event is applied if it is a safetensors update newer than the loaded weights (a finished
nccl/gloo broadcast cannot be joined late), then ``served`` is published once. While running,
every nccl event is joined in order (the trainer waits for all receivers); runs of safetensors events
collapse to the newest.
"""

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from bus.log import get_logger
from bus.messages import WeightUpdate
from bus.policy import publish_served
from bus.streams import Bus

Apply = Callable[[WeightUpdate], Awaitable[None]]
"""Loads one update into the served model (returns once requests see the new weights)."""


class WeightsFollower:
    """Reads ``weights`` (fan-out, no group) and keeps ``served`` on ``policy`` up to date."""

    def __init__(self, bus: Bus, server_id: str, apply: Apply, step: int = 0, block_ms: int = 1000):
        self.bus = bus
        self.server_id = server_id
        self.apply = apply
        self.step = step
        """Step of the weights being served."""
        self.block_ms = block_ms
        self.last_id = "0"
        self.log = get_logger(worker="inference", server=server_id, run=bus.keys.run)

    async def start(self) -> None:
        """Catch up with the newest event (if loadable) and publish ``served`` once."""
        newest = await self.bus.last(self.bus.keys.weights())
        if newest is not None:
            self.last_id, event = newest
            if isinstance(event, WeightUpdate) and event.step > self.step:
                if event.format == "safetensors":
                    await self._load(event)
                else:
                    self.log.warning("weights_broadcast_missed", step=event.step,
                                     reason="started after the broadcast; waiting for the next update")
        await publish_served(self.bus, self.server_id, self.step)
        self.log.info("served_published", step=self.step)

    async def run(self) -> None:
        """Follow the stream until cancelled."""
        while True:
            entries = await self.bus.read_fanout(self.bus.keys.weights(), self.last_id, block_ms=self.block_ms)
            if not entries:
                continue
            self.last_id = entries[-1][0]
            for event in _collapse([m for _, m in entries if isinstance(m, WeightUpdate)]):
                if event.step <= self.step and event.format == "safetensors":
                    continue
                if await self._load(event):
                    await publish_served(self.bus, self.server_id, self.step)

    async def _load(self, event: WeightUpdate) -> bool:
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            await self.apply(event)
        except (FileNotFoundError, ValueError) as e:
            # A pruned or mismatched directory: the next update replaces it.
            self.log.error("weights_load_failed", step=event.step, format=event.format, dir=event.dir, error=str(e))
            return False
        self.step = event.step
        self.log.info("weights_loaded", step=event.step, format=event.format,
                      dir=event.dir and Path(event.dir).name, load_s=round(loop.time() - start, 3))
        return True


def _collapse(events: list[WeightUpdate]) -> list[WeightUpdate]:
    """Keep every nccl event; of consecutive safetensors events keep only the newest."""
    out: list[WeightUpdate] = []
    for event in events:
        if out and event.format == "safetensors" and out[-1].format == "safetensors":
            out[-1] = event
        else:
            out.append(event)
    return out
