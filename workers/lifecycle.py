"""Running one worker process: connect, SIGTERM/SIGINT → drain, close.

Every worker class has ``setup()``, ``run()``, ``close()`` and ``request_stop()``; the role's
``main`` builds the worker and hands it to :func:`run_worker`. A worker with a ``bus`` has the reads blocked on it
woken by the signal too, so its loop sees the stop at once instead of after ``redis.block_ms``.
"""

import asyncio
import ctypes
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Protocol

from bus.errors import ConfigError
from bus.streams import Bus
from workers.config import RlbusConfig

PR_SET_PDEATHSIG = 1
"""prctl option: the signal a process gets when its parent dies (Linux)."""


class Worker(Protocol):
    async def setup(self) -> None: ...
    async def run(self) -> None: ...
    async def close(self) -> None: ...
    def request_stop(self) -> None: ...


def consumer_name(role: str, explicit: str | None = None) -> str:
    """A consumer name unique to this process: ``--consumer`` if given, else ``{role}-{host}-{pid}``."""
    return explicit or f"{role}-{socket.gethostname()}-{os.getpid()}"


OWNER_POLL_S = 0.5
"""How often :func:`stop_with` looks for its owner where the kernel has no pidfd."""

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""mallopt parameters (glibc's ``malloc.h``)."""
HEAP_BLOCK_MAX_BYTES = 32 * 2**20
"""Blocks up to this size come from malloc's heap, not a fresh mapping each (glibc's largest mmap threshold)."""
HEAP_KEEP_BYTES = 256 * 2**20
"""Freed heap memory a process keeps for reuse before it hands the top of its heap back to the kernel."""


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """preexec_fn: SIGTERM this child when ``parent_pid`` (the process spawning it) dies; exit at once if it already
    has."""

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


def stop_with(owner_pid: int) -> None:
    """SIGTERM this process when process ``owner_pid`` ends (what :func:`die_with_parent` gives a child whose parent
    is another process: a fork server's); exit at once if it already has. A daemon thread waits on the owner's pidfd,
    or, where the kernel offers none, looks for it every :data:`OWNER_POLL_S`."""
    try:
        pidfd = os.pidfd_open(owner_pid)
    except ProcessLookupError:
        os._exit(1)
    except OSError:  # no pidfd here (an old kernel, a sandbox)
        pidfd = None

    def watch() -> None:
        if pidfd is not None:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            poller.poll()
        else:
            while Path(f"/proc/{owner_pid}").exists():
                time.sleep(OWNER_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="rlbus-owner-watch", daemon=True).start()


async def stop_child(process: asyncio.subprocess.Process, exited: asyncio.Future | None = None,
                     grace_s: float = 5.0) -> None:
    """Stop a spawned child and reap it: SIGTERM, SIGKILL when it is still there after ``grace_s``.

    ``exited``: the future already waiting on ``process.wait()`` (a watcher's), awaited instead of a new wait."""
    exited = exited if exited is not None else asyncio.ensure_future(process.wait())
    if process.returncode is None and not exited.done():
        process.terminate()
        try:
            await asyncio.wait_for(asyncio.shield(exited), grace_s)
        except TimeoutError:
            process.kill()
    await exited


async def connect_bus(config: RlbusConfig, worker: str) -> Bus:
    """The run's Bus, renewing this worker's heartbeat (``rlbus health``); a missing ``redis.url`` is a user error
    naming the fix."""
    if not config.redis.url:
        raise ConfigError(
            "redis.url is unset; pass --redis.url redis://HOST:PORT/0 (or start everything with `rlbus run`)"
        )
    bus = await Bus.connect(config.redis.url, config.run.name, config.redis, worker=worker)
    bus.start_heartbeat()
    return bus


def keep_freed_memory() -> None:
    """Have glibc's malloc reuse the memory of freed tensors instead of mapping fresh pages for each.

    By default a block over 128 KiB (later, the largest freed so far) is a fresh ``mmap`` and free top-of-heap memory
    goes back to the kernel past twice that, so a step that allocates and frees a few MB of activations page-faults
    (and zeroes) every page of them again: ~2,000 faults and ~10 % of a CPU trainer step on the default job. With
    blocks up to :data:`HEAP_BLOCK_MAX_BYTES` served from the heap and :data:`HEAP_KEEP_BYTES` kept, a process holds
    at most its own peak. Where the C library has no ``mallopt`` (not glibc), nothing changes.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return
    mallopt(M_MMAP_THRESHOLD, HEAP_BLOCK_MAX_BYTES)
    mallopt(M_TRIM_THRESHOLD, HEAP_KEEP_BYTES)


async def run_worker(worker: Worker) -> int:
    """setup → run → close, with SIGTERM/SIGINT asking the worker to finish in-flight work and exit; freed memory is
    kept for reuse (:func:`keep_freed_memory`)."""
    keep_freed_memory()

    def stop() -> None:
        worker.request_stop()
        bus = getattr(worker, "bus", None)
        if isinstance(bus, Bus):
            bus.wake_blocked_reads()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    try:
        await worker.setup()
        await worker.run()
    finally:
        await worker.close()
    return 0


async def cancel_and_wait(tasks: list[asyncio.Task], timeout_s: float, log) -> None:
    """Cancel ``tasks`` and wait up to ``timeout_s`` for them to end; a task still running then is logged
    (``task_ignored_cancel``, with what it is awaiting) and left behind, so its owner still does its own shutdown
    (``asyncio.run`` itself still waits for such a task when the loop ends)."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    _, stuck = await asyncio.wait(tasks, timeout=timeout_s)
    for task in stuck:
        log.error("task_ignored_cancel", task=task.get_name(), awaiting=" <- ".join(awaited_frames(task)),
                  hint=f"it did not end within {timeout_s:.0f}s of being cancelled; going on without it")


def awaited_frames(task: asyncio.Task) -> list[str]:
    """Where a suspended task is, outermost first: ``file:line function`` along its chain of awaits."""
    frames, coro = [], task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            frames.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return frames


async def run_until_first(stop: asyncio.Event, *coros: Coroutine) -> None:
    """Run ``coros`` until one ends or ``stop`` is set (``request_stop``); cancel the rest, re-raise an error of the
    first."""
    tasks = [asyncio.create_task(stop.wait()), *(asyncio.create_task(c) for c in coros)]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        task.result()  # a dead follower, engine or child process crashes the worker
