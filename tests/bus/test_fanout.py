"""Reads without a consumer group against a real redis-server: ranges, every entry, the newest id, raw headers;
each read through the size check."""


from bus.messages import Metric


async def test_range_reads_check_the_size_and_skip_what_does_not_decode(bus):
    async with bus("w1", max_entry_bytes=4096) as b:
        metrics = b.keys.metrics()
        assert await b.last_id(metrics) == "0"
        small = [await b.publish(metrics, Metric(source=f"m{i}", values={})) for i in range(3)]
        await b.publish(metrics, Metric(source="x" * 5000, values={}))
        await b.redis.xadd(metrics, {"kind": "metric", "v": "1", "data": b"garbage"})
        assert [m.source for _, m in await b.read_range(metrics)] == ["m0", "m1", "m2"]
        newest = await b.read_range(metrics, high=small[2], count=2, newest_first=True)
        assert [i for i, _ in newest] == [small[2], small[1]]
        assert [m.source async for _, m in b.read_all(metrics, chunk=2)] == ["m0", "m1", "m2"]
        assert await b.last_id(metrics) not in small  # the garbage one


async def test_header_reads_return_raw_fields_after_each_last_id(bus):
    async with bus("w1") as b:
        metrics, dead = b.keys.metrics(), b.keys.dead()
        start = {metrics: await b.last_id(metrics), dead: await b.last_id(dead)}
        first = await b.publish(metrics, Metric(source="rollout", values={}))
        (stream, entry_id, fields), = await b.read_headers(start, count=10, block_ms=None)
        assert (stream, entry_id, fields[b"kind"], fields[b"source"]) == (metrics, first, b"metric", b"rollout")
        assert await b.read_headers({metrics: first, dead: "0"}, count=10, block_ms=None) == []
