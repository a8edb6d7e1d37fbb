"""Bus throughput vs bare redis-py, same run, same bytes, private redis-server.

A rollout-shaped message: one RolloutGroup with one sample of 256 prompt + 1024 completion token
ids, their logprobs and loss mask (~10 KB). The bus path encodes every message, publishes with
``Bus.publish_many`` (pipelined XADD of ``Message.entry_args``) and consumes with ``Bus.read_group`` (decode, every
check) + ``Bus.ack``; the bare path XADDs the already-encoded fields with a redis-py asyncio pipeline and consumes
with XREADGROUP + XACK. Rounds alternate bus/bare; the best round of each counts. Then each path's cost per message
and the codec's, in process: encode (``entry_args``, what the bus sends; of it msgpack; ``to_fields`` beside it),
packing the XADD (redis-py's ``pack_command`` on the bare fields, the bus's on ``entry_args``), and decode
(``decode``; of it msgpack into the struct with every check; beside it msgpack alone into plain values). Last line:
``bus/bare ratio: X`` (end-to-end msgs/s, publish + consume).

    python benchmarks/bus.py [--messages 4000] [--batch 64] [--rounds 5]
"""

import argparse
import asyncio
import gc
import sys
import time
import timeit
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path and its name shadows the `bus` package.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import numpy as np  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
from redis.asyncio.connection import Connection  # noqa: E402

from bus.arrays import pack_message, unpackb  # noqa: E402
from bus.codec import typed_decoder  # noqa: E402
from bus.config import RedisConfig  # noqa: E402
from bus.local_redis import LocalRedis  # noqa: E402
from bus.messages import RolloutGroup, Sample, decode  # noqa: E402
from bus.resp import fast_packing  # noqa: E402
from bus.streams import Bus  # noqa: E402


def rollout_message(seed: int) -> RolloutGroup:
    rng = np.random.default_rng(seed)
    sample = Sample(
        prompt_ids=rng.integers(0, 150_000, 256, dtype=np.int32),
        completion_ids=rng.integers(0, 150_000, 1024, dtype=np.int32),
        completion_logprobs=-rng.random(1024, dtype=np.float32),
        loss_mask=np.ones(1024, dtype=bool),
        reward=1.0,
        policy_version_start=3,
        policy_version_end=4,
    )
    return RolloutGroup(task_id=f"bench:0:{seed}", env="bench", example_id=str(seed), samples=[sample])


async def bus_round(bus: Bus, stream: str, messages: list[RolloutGroup], batch: int) -> tuple[float, float]:
    group = "bench"
    await bus.ensure_group(stream, group, start_id="$")
    start = time.perf_counter()
    for i in range(0, len(messages), batch):
        await bus.publish_many(stream, messages[i : i + batch])
    published = time.perf_counter()
    received = 0
    while received < len(messages):
        entries = await bus.read_group([stream], group, count=batch)
        await bus.ack(stream, group, [e.id for e in entries])
        received += len(entries)
    return published - start, time.perf_counter() - published


async def bare_round(client: aioredis.Redis, stream: str, fields: list[dict], batch: int, maxlen: int):
    group = "bench"
    await client.xgroup_create(stream, group, id="$", mkstream=True)
    start = time.perf_counter()
    for i in range(0, len(fields), batch):
        pipe = client.pipeline(transaction=False)
        for f in fields[i : i + batch]:
            pipe.xadd(stream, f, maxlen=maxlen, approximate=True)
        await pipe.execute()
    published = time.perf_counter()
    received = 0
    while received < len(fields):
        reply = await client.xreadgroup(group, "bare", {stream: ">"}, count=batch)
        ids = [entry_id for _, items in reply for entry_id, _ in items]
        await client.xack(stream, group, *ids)
        received += len(ids)
    return published - start, time.perf_counter() - published


def line(name: str, n: int, size: int, pub_s: float, con_s: float) -> str:
    total = pub_s + con_s
    return (
        f"{name:<5} publish {n / pub_s:8.0f} msg/s {n * size / pub_s / 1e6:6.1f} MB/s | "
        f"consume {n / con_s:8.0f} msg/s | end-to-end {n / total:8.0f} msg/s | a message: publish "
        f"{pub_s / n * 1e6:5.1f} us, consume {con_s / n * 1e6:5.1f} us"
    )


async def bench(url: str, n: int, batch: int, rounds: int) -> float:
    cfg = RedisConfig(url=url, maxlen=max(100_000, 2 * n))
    bus = await Bus.connect(url, "bench", cfg, "bench-consumer")
    client = aioredis.Redis.from_url(url, decode_responses=False)
    messages = [rollout_message(i) for i in range(n)]
    fields = [m.to_fields() for m in messages]
    # A worker holds no list of thousands of messages: keep the GC from rescanning these inputs.
    gc.collect()
    gc.freeze()
    size = sum(len(v) for v in fields[0].values())
    print(f"{n} messages of {size} bytes, batches of {batch}, {rounds} rounds")
    best: dict[str, tuple[float, float]] = {}
    for r in range(rounds):
        for name in ("bus", "bare"):
            stream = f"{bus.keys.prefix}bench:{name}:{r}"
            if name == "bus":
                times = await bus_round(bus, stream, messages, batch)
            else:
                times = await bare_round(client, stream, fields, batch, cfg.maxlen)
            await client.delete(stream)
            if name not in best or sum(times) < sum(best[name]):
                best[name] = times
    for name in ("bus", "bare"):
        print(line(name, n, size, *best[name]))
    await bus.close()
    await client.aclose()
    gc.unfreeze()
    return sum(best["bare"]) / sum(best["bus"])


def codec_costs(message: RolloutGroup, repeats: int = 9, number: int = 2000) -> list[tuple[str, float]]:
    """Microseconds per message of each codec part (best of ``repeats`` runs of ``number`` calls, the parts taking
    turns)."""
    fields = message.to_fields()
    wire = {k.encode(): v.encode() if isinstance(v, str) else v for k, v in fields.items()}
    xadd = ("XADD", "bench", "MAXLEN", "~", 100_000, "*")
    plain, fast = Connection(), fast_packing(Connection)()
    flat = [x for pair in fields.items() for x in pair]
    packed = message.entry_args()
    parts = [
        ("encode", message.entry_args),
        ("of it msgpack", lambda: pack_message(message)),
        ("to_fields", message.to_fields),
        ("XADD packing: redis-py on the fields", lambda: plain.pack_command(*xadd, *flat)),
        ("the bus on entry_args", lambda: fast.pack_command(*xadd, packed)),
        ("decode", lambda: decode(wire)),
        ("of it msgpack into the checked struct", lambda: typed_decoder(RolloutGroup).decode(wire[b"data"])),
        ("msgpack alone", lambda: unpackb(wire[b"data"])),
    ]
    best = {name: float("inf") for name, _ in parts}
    for _ in range(repeats):  # parts take turns, so a slow spell of this box does not land on one of them
        for name, fn in parts:
            best[name] = min(best[name], timeit.timeit(fn, number=number) / number * 1e6)
    return list(best.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with LocalRedis(aof=False) as server:
        ratio = asyncio.run(bench(server.url, args.messages, args.batch, args.rounds))
    costs = codec_costs(rollout_message(0))
    print("codec per message: " + ", ".join(f"{name} {us:.1f} us" for name, us in costs))
    print(f"bus/bare ratio: {ratio:.2f}")


if __name__ == "__main__":
    main()
