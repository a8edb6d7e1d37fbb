"""The preloaded parent of ``rlbus run``'s Python workers: imports torch, transformers and the workers' modules once,
then forks each worker from itself, so a worker (or its restart) starts without paying for those imports again.

    python -m workers.run.forkserver --socket PATH [--preload MODULE ...] [--model DIR] [--room N]

``rlbus run`` starts it first thing (a supervised child, stopped after every worker) and sends it each
``python -m MODULE ARGS…`` it would otherwise exec (:mod:`workers.forked` is the client). The socket lies in a
folder only the run's user can enter (``mkdtemp``: 0700). One connection per worker, a JSON line each way:
``{"argv", "env", "log", "watch"}`` in, ``{"pid"}`` out once forked, then ``{"exit"}`` (the code as
:class:`subprocess.Popen` reports it: negative for a signal) when the worker ends. The socket is bound before the
preload, so a request sent meanwhile waits in its backlog.

A forked worker is what its command line would have started: its own process group (with ``watch``, the group of
that process, where it would have been as that process's exec'd child), stdin from /dev/null, stdout
and stderr appended to its log, exactly the environment it was sent, ``sys.argv`` and ``/proc/PID/cmdline`` its own
command (written over this server's, which ``--room`` pads), the module run as ``__main__``. It gets SIGTERM when this
server dies (``PR_SET_PDEATHSIG``), as this server does when ``rlbus run`` dies, so a ``kill -9`` of the run still
takes every worker down; with ``watch``, also when that process ends (a forked rollout worker's env servers end with
it, as its exec'd ones would). The server stays single-threaded (``fork`` copies only the calling thread) and preloads
only imports (then freezes them out of the collector): no model is loaded, no device touched. Torch reads
``OMP_NUM_THREADS`` when it is imported, so every worker shares this server's thread settings, which ``rlbus run``
gives all of its workers alike.
"""

import argparse
import atexit
import contextlib
import ctypes
import gc
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from workers.lifecycle import die_with_parent, stop_with


@dataclass
class WorkerRequest:
    """What to run in a forked worker."""

    module: str
    args: list[str]
    env: dict[str, str]
    log: str
    watch: int | None = None
    """A process whose end SIGTERMs the worker (the worker that asked for it), besides this server's."""


def preload(modules: list[str], model: str | None) -> None:
    """Import ``modules`` and the architecture of the model at ``model`` (a local folder); what fails is reported
    and skipped: the worker that needs it imports it itself, and fails there if it must."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a preload is an optimisation, never a reason to stop
            print(f"forkserver: preloading {name} failed: {e!r}", file=sys.stderr, flush=True)
    if model and Path(model, "config.json").is_file():
        try:
            from transformers import AutoConfig
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

            MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model))]
        except Exception as e:  # noqa: BLE001
            print(f"forkserver: preloading the architecture of {model} failed: {e!r}", file=sys.stderr, flush=True)


def parse_request(line: bytes) -> WorkerRequest:
    """A request line as a :class:`WorkerRequest`; ValueError unless its argv is ``python -m MODULE ...``."""
    data = json.loads(line)
    argv, env, log = data["argv"], data["env"], data["log"]
    if len(argv) < 3 or argv[1] != "-m" or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"only `python -m MODULE ...` can be forked, not {argv!r}")
    if not isinstance(env, dict) or not isinstance(log, str):
        raise ValueError("env must be an object and log a path")
    watch = data.get("watch")
    if watch is not None and (not isinstance(watch, int) or watch <= 0):
        raise ValueError(f"watch must be a process id, not {watch!r}")
    return WorkerRequest(argv[2], argv[3:], {str(k): str(v) for k, v in env.items()}, log, watch)


class ForkServer:
    """Accepts requests on ``socket_path``, forks a worker for each, reports each worker's exit on its connection."""

    def __init__(self, socket_path: str):
        self.socket_path = socket_path
        self.pid = os.getpid()
        self.selector = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.workers: dict[int, socket.socket] = {}
        """Running worker pid → the connection that asked for it."""
        self.wakeup_r, self.wakeup_w = os.pipe()

    def listen(self) -> None:
        """Bind the socket: clients may connect from now on; they wait in its backlog until :meth:`serve`."""
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # a previous server's, which died
        self.listener.bind(self.socket_path)
        self.listener.listen(64)

    def serve(self) -> WorkerRequest:
        """Serve until a fork; returns in the forked child only (the server itself never returns)."""
        os.set_blocking(self.wakeup_w, False)
        signal.set_wakeup_fd(self.wakeup_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd gets a byte: reap at once
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.wakeup_r, selectors.EVENT_READ)
        while True:
            for key, _ in self.selector.select(timeout=1.0):
                if key.fileobj is self.wakeup_r:
                    os.read(self.wakeup_r, 4096)
                elif key.fileobj is self.listener:
                    request = self._accept()
                    if request is not None:
                        return request
            self._reap()

    def _accept(self) -> WorkerRequest | None:
        conn, _ = self.listener.accept()
        conn.settimeout(10.0)
        try:
            request = parse_request(_read_line(conn))
        except (OSError, ValueError, KeyError, TypeError) as e:
            _send(conn, {"error": str(e)})
            conn.close()
            return None
        if _hung_up(conn):  # the client gave up waiting (a long preload): it starts the worker itself
            conn.close()
            return None
        pid = os.fork()
        if pid == 0:
            self._close_for_child(conn)
            return request
        try:  # here too, so the group exists (or holds it) before the client hears the pid
            os.setpgid(pid, process_group(request, pid))
        except OSError:
            pass  # the child did it first, or is gone already (reaped below)
        self.workers[pid] = conn
        _send(conn, {"pid": pid})
        return None

    def _reap(self) -> None:
        while self.workers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.workers.pop(pid, None)
            if conn is not None:
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()

    def _close_for_child(self, conn: socket.socket) -> None:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.selector.close()
        self.listener.close()
        for other in [conn, *self.workers.values()]:
            other.close()
        os.close(self.wakeup_r)
        os.close(self.wakeup_w)


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _hung_up(conn: socket.socket) -> bool:
    conn.setblocking(False)
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        conn.settimeout(10.0)


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass  # the client went away; the worker runs on regardless


def process_group(request: WorkerRequest, pid: int) -> int:
    """The process group of worker ``pid``: its own, or with ``watch`` its owner's (an exec'd child of the owner would
    be in it, and the signals its supervisor sends the group reach it too)."""
    if request.watch is None:
        return pid
    try:
        return os.getpgid(request.watch)
    except ProcessLookupError:
        return pid  # the owner is gone: the worker exits at once (stop_with)


def become(request: WorkerRequest, server_pid: int) -> None:
    """Turn this forked child into the worker of ``request``; exits with its exit code (never returns)."""
    os.setpgid(0, process_group(request, os.getpid()))
    die_with_parent(server_pid)()  # SIGTERM when the server dies; exits at once if it already has
    if request.watch is not None:
        stop_with(request.watch)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    stdin = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(stdin, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(stdin)
    os.close(log)
    os.environ.clear()
    os.environ.update(request.env)
    if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator from the OS; so does each worker
        sys.modules["numpy"].random.seed()
    argv = [sys.executable, "-m", request.module, *request.args]
    write_cmdline(argv)
    sys.argv = [request.module, *request.args]
    os._exit(run_as_main(request.module))


def run_as_main(module: str) -> int:
    """Run ``module`` as ``__main__`` and end as the interpreter would, up to its teardown: its exit code, non-daemon
    threads joined, atexit functions run, output flushed. The teardown itself (every module's objects freed, the
    preloaded torch and transformers among them) is left to the exit, as a forked child of :mod:`multiprocessing`
    leaves it: it took a forked env server half a second, spent before its worker could stop."""
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = -signal.SIGINT  # ended by the signal below once the rest is done, as the interpreter does
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports it, exit code 1
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # noqa: SLF001 - what the interpreter's own exit does first
    atexit._run_exitfuncs()  # noqa: SLF001
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def write_cmdline(argv: list[str]) -> None:
    """Show ``argv`` as this process's ``/proc/PID/cmdline`` (``ps``, ``pgrep``): written over the original argument
    strings (as setproctitle does), cut to their room."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48 and 49)
    except (OSError, IndexError, ValueError):
        return
    room = end - start
    if room <= 1:
        return
    data = b"\0".join(os.fsencode(a) for a in argv)[:room - 1]
    ctypes.memmove(start, data.ljust(room, b"\0"), room)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--socket", required=True, help="UNIX socket path to serve on")
    parser.add_argument("--preload", nargs="*", default=[], help="modules to import before serving")
    parser.add_argument("--model", help="a local model folder whose architecture to import")
    parser.add_argument("--room", default="", help="padding that reserves room for the workers' command lines")
    args = parser.parse_args(argv)
    server = ForkServer(args.socket)
    server.listen()
    preload(args.preload, args.model)
    gc.freeze()  # no worker's collections walk what the preload built: its pages stay shared
    request = server.serve()
    become(request, server.pid)


if __name__ == "__main__":
    main()
