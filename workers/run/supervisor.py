"""Child-process supervision for ``rlbus run``: start, watch, restart with backoff, stop cleanly.

Each child runs in its own process group (so its own children, e.g. the env servers a rollout
worker spawns, are signalled with it) and gets ``PR_SET_PDEATHSIG`` (SIGTERM), so a supervisor
killed with ``kill -9`` still takes every child down. A child that exits non-zero (or by a signal)
is restarted after an exponential backoff; one that exits 0 has finished and stays down, and so does one
that exits 2 (a config error: it would fail the same way again). A child marked ``forkable`` is forked from the
preloaded fork server when one is given and answers (:mod:`workers.forked`), and exec'd as usual when not.

    sup = Supervisor(log_dir, on_event=print)
    sup.start(ChildSpec("trainer", "trainer", ["python", "-m", "workers.cli", "trainer", "@", "cfg.toml"]))
    while running: sup.poll(); time.sleep(0.5)
    sup.stop_all()
"""

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bus.errors import CONFIG_EXIT_CODE
from workers.forked import ForkedProcess, Forker, ForkUnavailable
from workers.lifecycle import die_with_parent


@dataclass
class ChildSpec:
    """What to run for one child."""

    name: str
    """Unique display name (``rollout-0``)."""
    role: str
    """Role name, the key of the restart counts (``rollout``)."""
    argv: list[str]
    """Command line."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables."""
    stop_order: int = 0
    """Children with a higher value are stopped later (redis last)."""
    forkable: bool = False
    """Start it from the supervisor's fork server when there is one (``argv`` is ``python -m MODULE ...``)."""


@dataclass
class Child:
    """A running (or waiting to restart) child."""

    spec: ChildSpec
    proc: subprocess.Popen | ForkedProcess | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 0.0
    restart_at: float | None = None
    """Monotonic time of the scheduled restart; None when running or finished."""
    exit_code: int | None = None
    """Last exit code (negative: killed by that signal)."""
    done: bool = False
    """Exited and will not be restarted."""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Starts children, restarts failed ones with exponential backoff, stops them all."""

    def __init__(
        self,
        log_dir: Path,
        *,
        on_event: Callable[[str, dict], None] | None = None,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
        healthy_after_s: float = 60.0,
    ):
        self.log_dir = Path(log_dir)
        self.on_event = on_event or (lambda event, info: None)
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.healthy_after_s = healthy_after_s
        self.forker: Forker | None = None
        """Where ``forkable`` children are forked from (None: every child is exec'd)."""
        self.children: dict[str, Child] = {}
        self.stopping = False

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start(self, spec: ChildSpec) -> Child:
        """Start a new child (its output appends to ``log_dir/{name}.log``)."""
        if spec.name in self.children:
            raise ValueError(f"a child named {spec.name!r} exists already")
        child = Child(spec)
        self._spawn(child)
        self.children[spec.name] = child
        return child

    def _spawn(self, child: Child) -> None:
        env = {**os.environ, **child.spec.env}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        child.proc = self._fork(child, env) if child.spec.forkable and self.forker is not None else None
        if child.proc is None:
            with open(self.log_path(child.spec.name), "ab") as log:
                child.proc = subprocess.Popen(
                    child.spec.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    process_group=0,
                    preexec_fn=die_with_parent(os.getpid()),
                )
        child.started_at = time.monotonic()
        child.restart_at = None
        self.on_event("child_started", {"name": child.spec.name, "pid": child.proc.pid, "restarts": child.restarts})

    def _fork(self, child: Child, env: dict[str, str]) -> ForkedProcess | None:
        """The child forked from the fork server; None (reported) when the server cannot."""
        try:
            return self.forker.spawn(child.spec.argv, env, self.log_path(child.spec.name))
        except ForkUnavailable as e:
            self.on_event("fork_unavailable", {"name": child.spec.name, "error": str(e)})
            return None

    def poll(self) -> None:
        """Notice exits, schedule restarts with backoff, start the ones that are due."""
        now = time.monotonic()
        for child in self.children.values():
            if not child.done and child.restart_at is None and child.proc.poll() is not None:
                self._on_exit(child, now)
            if child.restart_at is not None and now >= child.restart_at and not self.stopping:
                child.restarts += 1
                self._spawn(child)

    def _on_exit(self, child: Child, now: float) -> None:
        code = child.proc.returncode
        child.exit_code = code
        info = {"name": child.spec.name, "exit_code": code, "log": str(self.log_path(child.spec.name))}
        if self.stopping or code == 0 or code == CONFIG_EXIT_CODE:
            child.done = True
            self.on_event("child_exited", info)
            return
        if now - child.started_at >= self.healthy_after_s:
            child.backoff_s = 0.0
        child.backoff_s = min(self.backoff_max_s, max(self.backoff_initial_s, child.backoff_s * 2))
        child.restart_at = now + child.backoff_s
        self.on_event("child_restarting", {**info, "in_s": child.backoff_s, "restart": child.restarts + 1})

    def restarts_by_role(self) -> dict[str, int]:
        """Restarts per role, summed over the role's children."""
        out: dict[str, int] = {}
        for child in self.children.values():
            out[child.spec.role] = out.get(child.spec.role, 0) + child.restarts
        return out

    def done(self, name: str) -> bool:
        """True when the child exited and will not be restarted."""
        return self.children[name].done

    def stop_all(self, grace_s: float = 15.0, max_order: int | None = None) -> None:
        """SIGTERM every child's process group (by stop_order tiers), SIGKILL what is left after ``grace_s``.

        ``max_order``: stop only the tiers up to this stop_order (the rest keep running, never restarted).
        """
        self.stopping = True
        for order in sorted({c.spec.stop_order for c in self.children.values()}):
            if max_order is not None and order > max_order:
                continue
            tier = [c for c in self.children.values() if c.spec.stop_order == order]
            self._stop_tier(tier, grace_s)

    def _stop_tier(self, tier: list[Child], grace_s: float) -> None:
        for child in tier:
            child.restart_at = None
            if child.alive:
                _signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in tier:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.on_event("child_killed", {"name": child.spec.name, "after_s": grace_s})
            # Whatever is left of the group (the child or its own children) goes now.
            _signal_group(child.proc, signal.SIGKILL)
            child.proc.wait()


def _signal_group(proc: subprocess.Popen | ForkedProcess, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
