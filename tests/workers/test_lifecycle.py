"""Shutting down a worker's or the run's own tasks: a task that ignores its cancellation cannot hold the rest; a
stopped worker does not wait out its blocking read. A worker reuses the memory of the tensors it frees."""

import asyncio
import signal
import subprocess
import sys
import time

from tests.paths import REPO
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


def test_a_stopped_worker_exits_at_once_whatever_redis_block_ms(redis_url, run_name, tiny_model_dir, tmp_path):
    """SIGTERM wakes the worker's blocked read: a filter reading with a 10-minute block exits in seconds (it used
    to wait out the read, up to ``redis.block_ms``, at every tier of a run's shutdown)."""
    cfg_file = tmp_path / "cfg.toml"
    cfg_file.write_text(f'[run]\nname = "{run_name}"\n[redis]\nurl = "{redis_url}"\nblock_ms = 600000\n'
                        f'[model]\npath = "{tiny_model_dir}"\n[[env]]\nid = "reverse_text"\n')
    with subprocess.Popen([sys.executable, "-m", "workers.cli", "filter", "@", str(cfg_file)], cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as worker:
        try:
            for line in worker.stderr:
                if "filter_ready" in line:
                    break
            time.sleep(0.5)  # into its blocking read
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(timeout=30) == 0
        finally:
            worker.kill()
        assert "filter_stopped" in worker.stderr.read()


ALLOCATING_WORKER = """
import asyncio, resource, sys
import torch
from workers.lifecycle import run_worker

torch.set_num_threads(1)

class Allocating:
    async def setup(self): pass
    async def close(self): pass
    def request_stop(self): pass
    async def run(self):  # what a step does: activations alive together, then freed, over and over
        def step():
            first = torch.ones(2**21)  # 8 MiB
            return (first * 2) + (first * 3) + (first * 4)

        for _ in range(3):
            step()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(20):
            step()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

if sys.argv[1] == "worker":
    asyncio.run(run_worker(Allocating()))
else:
    asyncio.run(Allocating().run())
"""


def test_a_worker_reuses_freed_tensor_memory_instead_of_faulting_in_fresh_pages():
    """20 rounds of six 8 MiB tensors, four alive at once, then freed. As a worker the pages are reused (glibc's
    malloc keeps them): 0 faults, at times one tensor's 2,048. The same loop outside a worker faults most of them in
    afresh (by default malloc hands the freed top of its heap back to the kernel past twice the largest block it has
    freed): 170k–204k faults, at times ~10k, so the most of three runs counts."""

    def faults(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", ALLOCATING_WORKER, mode], cwd=REPO, capture_output=True,
                              text=True, check=True)
        return int(done.stdout.split()[-1])

    bare = max(faults("bare") for _ in range(3))
    worker = faults("worker")
    assert bare > 100_000, bare
    assert worker <= 4 * 2048, worker
