"""What ``redis.wait_replicas = 1`` costs a commit: the same commits with and without ``WAIT``, same run.

    python benchmarks/commit_wait.py [--commits 2000] [--rounds 3]

A primary and one replica (private redis-servers on loopback). Each commit acks one task and publishes one
rollout-shaped group (256 prompt + 1024 completion tokens, ~10 KB), as a rollout worker's does. Rounds
alternate; the best of each counts. Last line: ``wait/no-wait commits ratio: X`` (commits/s).
"""

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # this folder's bus.py would shadow the bus package

from bus.config import RedisConfig  # noqa: E402
from bus.local_redis import LocalRedis, free_port, redis_binary, redis_server_argv  # noqa: E402
from bus.messages import RolloutGroup, Sample, Task  # noqa: E402
from bus.streams import Bus  # noqa: E402


def group(i: int) -> RolloutGroup:
    sample = Sample(prompt_ids=list(range(256)), completion_ids=list(range(1024)), completion_logprobs=[-1.0] * 1024,
                    loss_mask=[True] * 1024, reward=1.0)
    return RolloutGroup(task_id=f"e:0:{i}", env="e", example_id=str(i), samples=[sample])


async def commits_per_s(url: str, wait_replicas: int, n: int, run: str) -> float:
    bus = await Bus.connect(url, run, RedisConfig(url=url, wait_replicas=wait_replicas), "bench")
    tasks, rollouts = bus.keys.tasks("e"), bus.keys.rollouts("e")
    await bus.ensure_group(tasks, "g")
    await bus.publish_many(tasks, [Task(task_id=f"e:0:{i}", env="e", example_index=i, example_id=str(i),
                                        group_size=1) for i in range(n)])
    entries = []
    while len(entries) < n:
        entries += await bus.read_group([tasks], "g", count=n)
    outputs = [group(i) for i in range(n)]
    start = time.perf_counter()
    for entry, output in zip(entries, outputs, strict=True):
        await bus.commit([(tasks, "g", entry.id)], [(rollouts, output)])
    elapsed = time.perf_counter() - start
    await bus.close()
    return n / elapsed


async def bench(url: str, n: int, rounds: int) -> dict[int, float]:
    best: dict[int, float] = {}
    for r in range(rounds):
        for wait in (0, 1):
            best[wait] = max(best.get(wait, 0.0), await commits_per_s(url, wait, n, f"wait{wait}-{r}"))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with LocalRedis(aof=False) as primary, tempfile.TemporaryDirectory() as replica_dir:
        port = free_port()
        replica = subprocess.Popen([*redis_server_argv(redis_binary(), port, Path(replica_dir), aof=False),
                                    "--replicaof", "127.0.0.1", str(primary.port)], stdout=subprocess.DEVNULL)
        try:
            time.sleep(1.0)  # the replica connects and syncs (an empty dataset)
            best = asyncio.run(bench(primary.url, args.commits, args.rounds))
        finally:
            replica.terminate()
            replica.wait()
    for wait, rate in best.items():
        print(f"wait_replicas = {wait}: {rate:.0f} commits/s ({1e6 / rate:.0f} µs a commit)")
    print(f"wait/no-wait commits ratio: {best[1] / best[0]:.2f}")


if __name__ == "__main__":
    main()
