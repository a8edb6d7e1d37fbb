"""How far one Redis carries a run: GPU-scale rollout groups through one private redis-server, rising load.

Each producer process is a rollout worker's commit loop: it publishes one ``RolloutGroup`` of ``--samples``
samples of ``T`` tokens each (a quarter prompt; the rest completion ids, logprobs and loss mask, as a GPU run sends
them) with ``Bus.commit`` (the Lua commit every stage uses; no ack, so no feeder is needed), back to back. Each
consumer process is a filter's read loop: ``Bus.read_group`` (decode, every check) and ``Bus.ack``. This process
trims the stream behind the consumers (``trim_consumed``, as the workers' upkeep does) and samples Redis. Every
level runs ``--seconds``; the load rises (``--levels``: producers, as many consumers) until sustained samples/s
rises by less than 10%. Per level: sustained samples/s (the lower of committed and consumed) and MB/s, p50/p99
commit latency, Redis CPU (``INFO cpu`` deltas over wall time, in cores), the samples/s at which Redis's one command
core would be full at that CPU per sample (an extrapolation: it holds where the clients, not Redis, ran out), peak
``used_memory``, the clients' CPU (their own ``getrusage``, in cores) and the whole box's (``/proc/stat``). At the
top level the same bytes go through bare redis-py (XADD of the encoded fields; XREADGROUP + XACK) for the ratio; then
which resource saturated first. Then Redis's own time for one commit of 1 to 64 MB of groups (a packer commits a
step's micro-batches at once; Redis serves nothing else meanwhile). Last line: ``bus/bare ratio: X`` (sustained MB/s
at the top level, the lowest over the token sizes).

    python benchmarks/bus_capacity.py [--tokens 2048 8192 32768] [--levels 1 2 4 8] [--seconds 5]
        [--commit-mb 1 4 16 64] [--quick]
"""

import argparse
import asyncio
import multiprocessing as mp
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path and its name shadows the `bus` package.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import numpy as np  # noqa: E402
import redis  # noqa: E402

from bus.config import RedisConfig  # noqa: E402
from bus.keys import Keys  # noqa: E402
from bus.local_redis import LocalRedis  # noqa: E402
from bus.messages import RolloutGroup, Sample  # noqa: E402
from bus.streams import Bus  # noqa: E402

RUN = "capacity"
GROUP = "filter"
READY_TIMEOUT_S = 120.0
"""Longest wait for the processes of a level to connect and build their messages."""
LATENCIES_MAX = 100_000
"""Most commit latencies one producer keeps."""
RISE_MIN = 1.10
"""A level that raises sustained samples/s by less than this factor ends the climb."""
SATURATED = 0.8
"""Share of its cores (one for Redis) at which a resource counts as saturated."""


def group_message(tokens: int, samples: int, seed: int) -> RolloutGroup:
    """One group of ``samples`` samples of ``tokens`` tokens: a quarter prompt ids, the rest completion ids with
    their logprobs and loss mask."""
    rng = np.random.default_rng(seed)
    prompt, completion = tokens // 4, tokens - tokens // 4
    return RolloutGroup(task_id=f"bench:0:{seed}", env="bench", example_id=str(seed), samples=[
        Sample(prompt_ids=rng.integers(0, 150_000, prompt, dtype=np.int32),
               completion_ids=rng.integers(0, 150_000, completion, dtype=np.int32),
               completion_logprobs=-rng.random(completion, dtype=np.float32),
               loss_mask=rng.random(completion) < 0.9, reward=1.0, policy_version_start=3, policy_version_end=4)
        for _ in range(samples)])


def cpu_s() -> float:
    """CPU seconds (user + system) this process has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def box_cpu_s() -> float | None:
    """CPU seconds every core of this machine has been busy (``/proc/stat``, every process); None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:
        return None
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


@dataclass
class Job:
    """What one child process does: its role, where, and the events that open and close the window."""

    role: str  # "producer" or "consumer"
    bare: bool
    url: str
    stream: str
    tokens: int
    samples: int
    index: int


async def produce(job: Job, ready, start, stop) -> dict:
    message = group_message(job.tokens, job.samples, job.index)
    fields = message.to_fields()
    bus = await Bus.connect(job.url, RUN, RedisConfig(url=job.url), f"producer-{job.index}")
    ready.release()
    start.wait(READY_TIMEOUT_S)
    cpu0, latencies = cpu_s(), []
    while not stop.is_set() and len(latencies) < LATENCIES_MAX:
        t0 = time.perf_counter()
        if job.bare:
            await bus.redis.xadd(job.stream, fields)
        else:
            await bus.commit([], [(job.stream, message)])
        latencies.append(time.perf_counter() - t0)
    cpu = cpu_s() - cpu0
    await bus.close()
    return {"role": "producer", "groups": len(latencies), "latencies": latencies, "cpu_s": cpu}


async def consume(job: Job, ready, start, stop) -> dict:
    bus = await Bus.connect(job.url, RUN, RedisConfig(url=job.url), f"consumer-{job.index}")
    name = f"consumer-{job.index}"
    ready.release()
    start.wait(READY_TIMEOUT_S)
    cpu0, groups = cpu_s(), 0
    while not stop.is_set():
        if job.bare:
            reply = await bus.redis.xreadgroup(GROUP, name, {job.stream: ">"}, count=4, block=100)
            ids = [entry_id for _, items in reply or [] for entry_id, _ in items]
            if ids:
                await bus.redis.xack(job.stream, GROUP, *ids)
        else:
            ids = [e.id for e in await bus.read_group([job.stream], GROUP, count=4, block_ms=100)]
            await bus.ack(job.stream, GROUP, ids)
        groups += len(ids)
    cpu = cpu_s() - cpu0
    await bus.close()
    return {"role": "consumer", "groups": groups, "cpu_s": cpu}


def child(job: Job, ready, start, stop, results) -> None:
    """Entry point of a producer or consumer process."""
    role = produce if job.role == "producer" else consume
    results.put(asyncio.run(role(job, ready, start, stop)))


@dataclass
class Level:
    """The figures of one level."""

    producers: int
    bare: bool
    wall_s: float
    committed: int
    consumed: int
    group_bytes: int
    samples: int
    latencies: list[float]
    redis_cpu: float
    redis_memory: int
    client_cpu: float
    box_cpu: float | None

    @property
    def samples_per_s(self) -> float:
        return min(self.committed, self.consumed) * self.samples / self.wall_s

    @property
    def mb_per_s(self) -> float:
        return min(self.committed, self.consumed) * self.group_bytes / self.wall_s / 1e6

    @property
    def redis_ceiling(self) -> float:
        """Samples/s at which Redis would use its one command core, its CPU per sample held (an extrapolation)."""
        return self.samples_per_s / self.redis_cpu if self.redis_cpu > 0 else float("inf")

    def line(self) -> str:
        p50, p99 = (np.percentile(self.latencies, [50, 99]) * 1e3) if self.latencies else (float("nan"),) * 2
        return (f"{'bare' if self.bare else 'bus':<4} {self.producers:>2} producers + {self.producers:>2} consumers: "
                f"{self.samples_per_s:8.0f} samples/s {self.mb_per_s:7.1f} MB/s (committed "
                f"{self.committed * self.samples / self.wall_s:.0f}, "
                f"consumed {self.consumed * self.samples / self.wall_s:.0f}"
                f" samples/s) | commit p50 {p50:6.1f} ms p99 {p99:6.1f} ms | redis cpu {self.redis_cpu:4.2f} cores, "
                f"peak used_memory {self.redis_memory / 2**20:6.1f} MiB, one core at {self.redis_ceiling:.0f} samples/s"
                f" | clients cpu {self.client_cpu:4.2f} cores"
                + ("" if self.box_cpu is None else f", the box busy {self.box_cpu:4.2f} cores"))


def redis_cpu_s(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def watch(url: str, stream: str, seconds: float) -> int:
    """Trim ``stream`` behind its group every 0.2 s for ``seconds`` (as the workers' upkeep does); the peak
    ``used_memory`` seen."""
    bus = await Bus.connect(url, RUN, RedisConfig(url=url), "trimmer")
    peak, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        await bus.trim_consumed(stream)
        peak = max(peak, int((await bus.redis.info("memory"))["used_memory"]))
        await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    await bus.close()
    return peak


def run_level(url: str, tokens: int, samples: int, producers: int, bare: bool, seconds: float) -> Level:
    """One level: ``producers`` producers and as many consumers for ``seconds``, after all have connected."""
    ctx = mp.get_context("spawn")
    ready, start, stop, results = ctx.Semaphore(0), ctx.Event(), ctx.Event(), ctx.Queue()
    client = redis.Redis.from_url(url)
    stream = Keys(RUN).rollouts(f"{'bare' if bare else 'bus'}-{tokens}-{producers}")
    client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    jobs = [Job(role, bare, url, stream, tokens, samples, i) for role in ("producer", "consumer")
            for i in range(producers)]
    procs = [ctx.Process(target=child, args=(job, ready, start, stop, results), daemon=True) for job in jobs]
    try:
        for p in procs:
            p.start()
        for _ in procs:
            if not ready.acquire(timeout=READY_TIMEOUT_S):
                raise RuntimeError(f"a benchmark process did not start within {READY_TIMEOUT_S}s")
        cpu0, box0, t0 = redis_cpu_s(client), box_cpu_s(), time.perf_counter()
        start.set()
        memory = asyncio.run(watch(url, stream, seconds))
        stop.set()
        wall, redis_cpu, box1 = time.perf_counter() - t0, redis_cpu_s(client) - cpu0, box_cpu_s()
        reports = [results.get(timeout=READY_TIMEOUT_S) for _ in procs]
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        client.delete(stream)
        client.close()
    made = [r for r in reports if r["role"] == "producer"]
    group_bytes = sum(len(v) for v in group_message(tokens, samples, 0).to_fields().values())
    return Level(producers, bare, wall, sum(r["groups"] for r in made),
                 sum(r["groups"] for r in reports if r["role"] == "consumer"), group_bytes, samples,
                 [x for r in made for x in r["latencies"]], redis_cpu / wall, memory,
                 sum(r["cpu_s"] for r in reports) / wall, None if box0 is None else (box1 - box0) / wall)


def saturated_first(top: Level) -> str:
    """Which resource ran out at ``top``: Redis's one command thread, the clients' cores, the box's cores (other
    processes included), or none of them (then the loopback copies and round trips bound it)."""
    cores = os.cpu_count() or 1
    if top.redis_cpu >= SATURATED:
        return f"redis cpu ({top.redis_cpu:.2f} of the one core Redis runs commands on)"
    if top.redis_cpu + top.client_cpu >= SATURATED * cores:
        return (f"client cpu (the clients {top.client_cpu:.2f} + Redis {top.redis_cpu:.2f} cores of this box's "
                f"{cores}; Redis itself had headroom)")
    if top.box_cpu is not None and top.box_cpu >= SATURATED * cores:
        return (f"the box's cpu, taken by other processes ({top.box_cpu:.2f} of {cores} cores busy; the clients "
                f"{top.client_cpu:.2f}, Redis {top.redis_cpu:.2f}): rerun on a quiet machine")
    return (f"neither cpu (Redis {top.redis_cpu:.2f}, clients {top.client_cpu:.2f} of {cores} cores): "
            f"loopback copies and round trips, {top.mb_per_s:.0f} MB/s")


def climb(url: str, tokens: int, samples: int, levels: list[int], seconds: float) -> tuple[Level, Level]:
    """Run the levels until sustained samples/s stops rising; the top bus level and the bare run at it."""
    group_bytes = sum(len(v) for v in group_message(tokens, samples, 0).to_fields().values())
    print(f"\n{tokens} tokens x {samples} samples a group ({group_bytes / 1e6:.2f} MB), {seconds:g} s a level")
    top: Level | None = None
    for producers in levels:
        level = run_level(url, tokens, samples, producers, False, seconds)
        print(level.line(), flush=True)
        rising = top is None or level.samples_per_s >= RISE_MIN * top.samples_per_s
        if top is None or level.samples_per_s > top.samples_per_s:
            top = level
        if not rising:
            break
    bare = run_level(url, tokens, samples, top.producers, True, seconds)
    print(bare.line(), flush=True)
    print(f"saturation ({tokens} tokens): {top.samples_per_s:.0f} samples/s, {top.mb_per_s:.1f} MB/s at "
          f"{top.producers} producers; first saturated: {saturated_first(top)}; Redis's one core would carry "
          f"{top.redis_ceiling:.0f} samples/s ({top.redis_ceiling / top.samples_per_s * top.mb_per_s:.0f} MB/s) "
          f"at its CPU per sample here, bare redis-py {bare.redis_ceiling:.0f}")
    print(f"bus/bare ratio ({tokens} tokens): {top.mb_per_s / bare.mb_per_s:.2f}")
    return top, bare


async def big_commits(url: str, sizes_mb: list[int], tokens: int, samples: int) -> list[tuple[float, float]]:
    """Redis's time (``commandstats``, EVALSHA) for one commit of about each of ``sizes_mb`` MB of groups, as the
    packer commits a whole step: (MB, ms); Redis runs nothing else meanwhile."""
    bus = await Bus.connect(url, RUN, RedisConfig(url=url), "packer")
    stream, message = Keys(RUN).batches(1), group_message(tokens, samples, 0)
    group_mb = sum(len(v) for v in message.to_fields().values()) / 1e6
    found = []
    for mb in sizes_mb:
        copies = max(1, round(mb / group_mb))
        await bus.redis.config_resetstat()
        for _ in range(3):
            await bus.commit([], [(stream, message)] * copies)
            await bus.redis.delete(stream)
        stats = await bus.redis.info("commandstats")
        found.append((copies * group_mb, stats["cmdstat_evalsha"]["usec_per_call"] / 1e3))
    await bus.close()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768], help="tokens a sample")
    parser.add_argument("--samples", type=int, default=16, help="samples a group")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8], help="producers (= consumers)")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds a level")
    parser.add_argument("--commit-mb", type=int, nargs="+", default=[1, 4, 16, 64],
                        help="sizes of the one-commit measurement (a packer's step), MB")
    parser.add_argument("--quick", action="store_true",
                        help="8192 tokens, levels 1 2 4, 2 s a level, commits up to 16 MB (< 60 s)")
    args = parser.parse_args()
    if args.quick:
        args.tokens = [8192] if args.tokens == parser.get_default("tokens") else args.tokens
        args.levels = [1, 2, 4] if args.levels == parser.get_default("levels") else args.levels
        args.seconds = 2.0 if args.seconds == parser.get_default("seconds") else args.seconds
        args.commit_mb = [1, 4, 16] if args.commit_mb == parser.get_default("commit_mb") else args.commit_mb
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; one private redis-server (no AOF)")
    with LocalRedis(aof=False) as server:
        ratios = [top.mb_per_s / bare.mb_per_s
                  for top, bare in (climb(server.url, t, args.samples, args.levels, args.seconds)
                                    for t in args.tokens)]
        commits = asyncio.run(big_commits(server.url, args.commit_mb, 8192, args.samples))
    print("\none commit (the packer commits a step at once; Redis serves no one else meanwhile): "
          + ", ".join(f"{mb:.0f} MB {ms:.0f} ms ({ms / mb:.1f} ms/MB)" for mb, ms in commits))
    print(f"bus/bare ratio: {min(ratios):.2f}")


if __name__ == "__main__":
    main()
