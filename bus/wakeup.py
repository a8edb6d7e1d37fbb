"""Blocking stream reads that a stopping worker wakes at once.

A worker's loop reads with ``XREAD[GROUP] … BLOCK redis.block_ms`` and checks its stop flag between reads, so a
SIGTERM used to wait out the read in flight: up to a second for each worker, and for each tier of ``rlbus run``'s
shutdown. :meth:`BlockedReads.wake` ends the reads waiting at that moment with no entries, as Redis's
``CLIENT UNBLOCK`` would. A read started afterwards blocks as usual, so a loop that checks no stop flag goes
round once more instead of spinning.

A woken read is cancelled on the client: redis-py drops that connection, so Redis unblocks it and delivers
nothing to it (an XREADGROUP that Redis answered in the same instant leaves its entries pending, where
``Bus.reclaim`` finds them, as after a ``kill -9``).
"""

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class BlockedReads:
    """The blocking reads of one worker's :class:`bus.streams.Bus`, and the means to wake them."""

    def __init__(self) -> None:
        self._woken = asyncio.Event()

    def wake(self) -> None:
        """End every read blocked now with no entries (callable from a signal handler on the event loop)."""
        self._woken.set()
        self._woken = asyncio.Event()

    async def read(self, read: Awaitable[T], block_ms: int | None) -> T | None:
        """Await ``read``, a Redis call that blocks up to ``block_ms`` (None: it returns at once, so it is simply
        awaited); None when :meth:`wake` came first."""
        if block_ms is None:
            return await read
        woken = asyncio.ensure_future(self._woken.wait())
        reading = asyncio.ensure_future(read)
        try:
            await asyncio.wait((reading, woken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            reading.cancel()  # a no-op once it has its reply: that reply is still returned below
        try:
            return await reading
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # the caller itself is being cancelled
                raise
            return None
