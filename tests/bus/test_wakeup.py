"""A stopping worker wakes its blocked reads (``Bus.wake_blocked_reads``): each returns no entries at once, takes
nothing from the stream, and the next read blocks and receives as usual."""

import asyncio

from bus.messages import Metric, Task

GROUP = "filter"


def task(i: int) -> Task:
    return Task(task_id=f"e:0:{i}", env="e", example_index=i, example_id=str(i), group_size=2)


async def test_reads_blocked_forever_return_nothing_when_woken_and_the_next_read_still_works(bus):
    async with bus("reader") as b, bus("writer") as w:
        tasks, metrics = b.keys.tasks("e"), b.keys.metrics()
        await b.ensure_group(tasks, GROUP)
        blocked = [
            asyncio.create_task(b.read_group([tasks], GROUP, block_ms=0)),  # 0: Redis waits forever
            asyncio.create_task(b.read_fanout(metrics, "$", block_ms=0)),
            asyncio.create_task(b.read_fanout(metrics, "$", block_ms=0, replicated=True)),
            asyncio.create_task(b.read_headers({metrics: "$"}, count=10, block_ms=0)),
        ]
        await asyncio.sleep(0.2)
        assert not any(t.done() for t in blocked)
        b.wake_blocked_reads()
        assert await asyncio.wait_for(asyncio.gather(*blocked), 5) == [[], [], [], []]
        assert (await b.redis.xpending(tasks, GROUP))["pending"] == 0  # nothing was delivered to a woken read

        reader = asyncio.create_task(b.read_group([tasks], GROUP, block_ms=0))  # a read after the wake blocks
        await asyncio.sleep(0.2)
        assert not reader.done()
        await w.publish(tasks, task(0))
        [entry] = await asyncio.wait_for(reader, 5)
        assert entry.message.task_id == "e:0:0"
        last = await b.last_id(metrics)
        await w.publish(metrics, Metric(source="rollout", values={}))
        [(_, metric)] = await b.read_fanout(metrics, last, block_ms=0)
        assert metric.source == "rollout"


async def test_a_read_cancelled_by_its_caller_is_cancelled_not_woken(bus):
    async with bus("reader") as b:
        stream = b.keys.tasks("e")
        await b.ensure_group(stream, GROUP)
        reader = asyncio.create_task(b.read_group([stream], GROUP, block_ms=0))
        await asyncio.sleep(0.1)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        assert reader.cancelled()
