"""Shutting down a worker's or the run's own tasks: a task that ignores its cancellation cannot hold the rest."""

import asyncio
import time

from workers.lifecycle import cancel_and_wait


class Log:
    def __init__(self):
        self.errors = []

    def error(self, event, **fields):
        self.errors.append((event, fields))


async def obeys():
    await asyncio.sleep(3600)


async def ignores_cancel():
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            continue  # what a retry loop that takes the cancellation for a timeout does


async def test_a_task_that_ignores_its_cancel_is_named_with_where_it_waits_and_left_behind():
    log = Log()
    polite = asyncio.create_task(obeys(), name="polite")
    stubborn = asyncio.create_task(ignores_cancel(), name="stubborn")
    await asyncio.sleep(0)
    started = time.monotonic()
    await cancel_and_wait([polite, stubborn], 0.3, log)
    assert time.monotonic() - started < 2
    assert polite.cancelled() and not stubborn.done()
    stubborn.get_coro().close()
    [(event, fields)] = log.errors
    assert event == "task_ignored_cancel" and fields["task"] == "stubborn"
    assert "ignores_cancel" in fields["awaiting"] and "sleep" in fields["awaiting"], fields
