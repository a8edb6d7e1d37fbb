"""Where each role's time goes during a run: py-spy samples every process of one ``rlbus run``.

    pip install -e '.[bench]'     # py-spy
    python benchmarks/profile_roles.py [--config configs/default.toml] [--warm 30] [--seconds 30] [--top 6]

Starts ``rlbus run`` (a fresh output folder, a free inference port; other arguments are overrides), waits for step
``--warm`` (compilation and start-up are over), then, for ``--seconds``, reads each process's CPU time from ``/proc``
and samples its Python stacks with py-spy (``--nonblocking``, 50 Hz; idle threads are not sampled, so the shares are
of its busy time). Then it stops the run. Per role it prints the share of one core it used, steps trained in the
window, and its top functions: inclusive (the repository's own, where a step's work is decided) and self (any module:
where the CPU actually goes). Last line: ``cpu per step: …`` (core-seconds per trained step, by role).
"""

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("bus/", "workers/", "trainer/")
"""Folders of the repository's own code, as they appear in py-spy's frame file names."""
TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Every descendant of ``pid``."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            kids = [int(k) for k in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def role_of(pid: int) -> str | None:
    """``rollout-0``, ``trainer``, ``env:NAME``… from a process's command line (None: not an rlbus process)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    args = [a.decode(errors="replace") for a in argv if a]
    if "workers.cli" not in args and not any(a.endswith("/rlbus") for a in args):
        return "redis" if args and "redis-server" in args[0] else None
    if "workers.run.forkserver" in args:
        return "forkserver"
    cli = args[args.index("workers.cli") + 1:] if "workers.cli" in args else args[2:]
    role = cli[0] if cli else "?"
    if role == "env" and "--name" in cli:
        return f"env:{cli[cli.index('--name') + 1]}"
    for flag in ("--consumer", "--server-id"):
        if flag in cli:
            return cli[cli.index(flag) + 1]
    return role


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def trained_step(stdout: Path) -> int:
    steps = re.findall(r"^step (\d+)/", stdout.read_text(errors="replace"), flags=re.M)
    return int(steps[-1]) if steps else 0


def frames(line: str) -> tuple[list[str], int]:
    """A py-spy raw line (``frame;frame;… count``) as its frames, outermost first, and its sample count."""
    stack, _, count = line.rpartition(" ")
    return stack.split(";"), int(count)


def short(frame: str) -> str:
    """``function (path/to/module.py:line)`` → ``module.py:function`` (the repository's paths from its root)."""
    match = re.match(r"(.*) \((.*?):\d+\)$", frame)
    if not match:
        return frame
    function, path = match.groups()
    for folder in OURS:
        if f"/{folder}" in f"/{path}":
            return f"{folder}{f'/{path}'.rsplit('/' + folder, 1)[-1]}:{function}"
    return f"{Path(path).name}:{function}"


def summarize(raw: Path, top: int) -> tuple[int, list[tuple[str, float]], list[tuple[str, float]]]:
    """Busy samples, then the top inclusive functions of the repository and the top self functions of any module,
    each with its share of the busy samples."""
    inclusive, own, total = Counter(), Counter(), 0
    for line in raw.read_text(errors="replace").splitlines() if raw.exists() else []:
        if not line.strip():
            continue
        stack, count = frames(line)
        total += count
        names = [short(f) for f in stack]
        own[names[-1]] += count
        for name in set(names):
            if name.startswith(OURS):
                inclusive[name] += count
    share = (lambda c: [(n, k / total) for n, k in c.most_common(top)]) if total else (lambda c: [])
    return total, share(inclusive), share(own)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "default.toml")
    parser.add_argument("--warm", type=int, default=30, help="step to wait for before sampling")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long to sample")
    parser.add_argument("--top", type=int, default=6, help="functions listed per role and kind")
    parser.add_argument("--rate", type=int, default=50, help="py-spy samples per second per process")
    args, overrides = parser.parse_known_args()
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        raise SystemExit("py-spy is not installed: pip install -e '.[bench]'")
    with tempfile.TemporaryDirectory(prefix="rlbus-profile-") as tmp:
        out = Path(tmp) / "run"
        stdout = Path(tmp) / "run.stdout"
        argv = [sys.executable, "-m", "workers.cli", "run", "@", str(args.config), "--run.output_dir", str(out),
                "--run.name", "profile", "--run.max_steps", "100000", "--inference.port", str(free_port()), *overrides]
        with open(stdout, "w") as log:
            run = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 600
            while trained_step(stdout) < args.warm:
                if run.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the run never reached step {args.warm}:\n{stdout.read_text()[-3000:]}")
                time.sleep(0.5)
            roles = {pid: role for pid in [run.pid, *children(run.pid)] if (role := role_of(pid))}
            roles[run.pid] = "run (status, metrics, eval)"
            raws = {pid: Path(tmp) / f"{pid}.txt" for pid in roles}
            spies = [subprocess.Popen([str(spy), "record", "--pid", str(pid), "--duration", str(int(args.seconds)),
                                       "--rate", str(args.rate), "--nonblocking", "--format", "raw", "--output",
                                       str(raws[pid])], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for pid, role in roles.items() if role != "redis"]
            cpu0, step0, t0 = {pid: cpu_seconds(pid) for pid in roles}, trained_step(stdout), time.monotonic()
            for spied in spies:
                spied.wait(args.seconds + 60)
            cpu1, step1, wall = {pid: cpu_seconds(pid) for pid in roles}, trained_step(stdout), time.monotonic() - t0
        finally:
            run.send_signal(signal.SIGINT)
            try:
                run.wait(60)
            except subprocess.TimeoutExpired:
                run.kill()
        stacks = {pid: summarize(raw, args.top) for pid, raw in raws.items()}  # before the folder goes
    steps = step1 - step0
    print(f"{args.config.name}: {steps} steps in {wall:.1f} s ({steps / wall:.2f} steps/s) from step {step0}")
    per_step = []
    for pid, role in sorted(roles.items(), key=lambda item: cpu0[item[0]] - cpu1[item[0]]):
        cpu = cpu1[pid] - cpu0[pid]
        per_step.append(f"{role} {cpu / max(steps, 1):.3f}")
        busy, inclusive, own = stacks.get(pid, (0, [], []))
        print(f"\n{role}: {cpu / wall:.0%} of a core, {cpu / max(steps, 1) * 1000:.0f} ms CPU a step")
        if inclusive:
            print("  inclusive: " + " | ".join(f"{name} {share:.0%}" for name, share in inclusive))
        if own:
            print("  self:      " + " | ".join(f"{name} {share:.0%}" for name, share in own))
    print(f"\ncpu per step: {', '.join(per_step)} (core-seconds)")


if __name__ == "__main__":
    main()
