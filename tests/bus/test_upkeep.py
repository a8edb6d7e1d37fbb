"""Upkeep of the consumer-group streams against a real redis-server: trimming behind the slowest group."""


from bus.messages import Task

GROUP = "rollout"


def task(i: int) -> Task:
    return Task(task_id=f"e:0:{i}", env="e", example_index=i, example_id=str(i), group_size=2)


async def test_group_streams_are_trimmed_by_consumption_never_past_a_pending_entry(bus):
    async with bus("w1", maxlen=3) as b:
        stream = b.keys.tasks("e")
        await b.ensure_group(stream, GROUP)
        await b.publish_many(stream, [task(i) for i in range(10)])
        assert await b.redis.xlen(stream) == 10  # MAXLEN never applies to a consumer group's stream
        first = await b.read_group([stream], GROUP, count=6)
        await b.ack(stream, GROUP, [e.id for e in first[:2]] + [e.id for e in first[3:]])  # 2 stays pending
        await b.trim_consumed(stream)
        left = [e[0].decode() for e in await b.redis.xrange(stream)]
        assert left[0] == first[2].id and len(left) == 8  # the pending one and the 4 never delivered stay
        await b.ack(stream, GROUP, [first[2].id])
        await b.trim_consumed(stream)
        assert [e[0].decode() for e in await b.redis.xrange(stream)][0] == first[5].id  # the last delivered
        await b.ensure_group(stream, "second", start_id="0")  # a second group that has read nothing
        await b.publish(stream, task(10))
        await b.trim_consumed(stream)
        assert await b.redis.xlen(stream) == 6


async def test_a_trim_racing_the_last_ack_of_a_group_does_not_crash(bus):
    async with bus("w1") as b:
        stream = b.keys.tasks("e")
        await b.publish_many(stream, [task(i) for i in range(3)])
        entries = await b.read_group([stream], GROUP, count=3)
        real = b.redis.xpending

        async def acked_meanwhile(key, group):  # XINFO saw pending entries; the ack landed before XPENDING
            await b.ack(stream, GROUP, [e.id for e in entries])
            return await real(key, group)

        b.redis.xpending = acked_meanwhile
        assert await b.trim_consumed(stream) == 2  # MINID keeps the last delivered entry itself
