"""One ``rlbus run`` on this machine, supervised (:mod:`workers.run.chain` runs one per ``[[stage]]``).

Starts, in order: a private redis-server (unless ``redis.url`` is set; its AOF lives in
``output_dir/redis`` so ``--resume`` gets the streams back), the model folder (``init-model``)
if missing, the inference server(s) and beside them filter × ``filter.workers``, packer, trainer and rollout ×
``rollout.workers`` (each spawns its env servers); once every server answers ``/health``, the feeder, so no task
reaches a rollout worker before a server can answer it.
Every child gets the resolved config (``output_dir/config.resolved.toml``) and its share of the
cores as torch threads. In this process: the live status, ``metrics.jsonl``, the eval
coordinator. The run ends when ``trained == run.max_steps`` (after that step's eval), on Ctrl-C /
SIGTERM, or when a worker sets the run's ``stop_reason``; then it stops every child and writes
``summary.json`` and ``report.png``.

``--attach`` does the in-process part only (status, metrics, eval, summary) for a run whose
workers run elsewhere (docker compose); it needs ``redis.url``.
"""

import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from rich.console import Console
from rich.live import Live

from bus import curve
from bus.config import redact
from bus.errors import CONFIG_EXIT_CODE, ConfigError, RlbusError
from bus.local_redis import free_port, port_free, redis_answers, redis_binary, redis_server_argv, write_secret
from bus.log import get_logger
from bus.messages import Metric
from bus.state import DATA_EXHAUSTED, STOP_REASON_FIELD, exhausted_at
from bus.streams import Bus
from workers.config import RlbusConfig
from workers.lifecycle import cancel_and_wait
from workers.run.accounting import group_counts
from workers.run.checks import check_envs, check_has_env, check_models, check_wandb
from workers.run.eval import EvalCoordinator
from workers.run.hub import is_hub_id
from workers.run.metrics import MetricsWriter, wandb_config
from workers.run.preload import ForkServer
from workers.run.report import bench_numbers, build_summary, pyplot, summary_text, write_report, write_summary
from workers.run.resolved import child_password, dump_toml, needs_teacher_server, resolve, torch_threads
from workers.run.status import RunProbe, render
from workers.run.status_report import StatusReporter
from workers.run.supervisor import ChildSpec, Supervisor
from workers.tools.exporter import Exporter
from workers.tools.run_follower import READ_PAUSE_S

BACKGROUND_STOP_S = 10.0
"""How long the run waits for its own tasks (metrics, eval, supervision) to end once cancelled; then it stops the
workers and writes its summary without them. (A CI run hung here for good: its eval task went on after its cancel,
inside redis-py reads under a socket timeout; the process's exit still waits for such a task.)"""

SETTLE_TRIES = 20
"""Recounts of the groups at the end of an --attach run while its workers keep committing (see _settled_counts)."""

RUN_STATE = ("redis", "weights", "checkpoints", "logs", "wandb", "metrics.jsonl", "summary.json", "report.png")
"""What a fresh run clears from output_dir (a resumed run keeps it)."""

REPO_ROOT = Path(__file__).resolve().parents[2]


class RunSession:
    """One ``rlbus run``: children, status, metrics, eval, and the end-of-run files."""

    def __init__(self, config: RlbusConfig, *, resume: bool, attach: bool, grace_s: float, health_timeout_s: float):
        self.config = config
        self.resume = resume
        self.attach = attach
        self.grace_s = grace_s
        self.health_timeout_s = health_timeout_s
        self.output_dir = Path(config.run.output_dir)
        self.log = get_logger(worker="run", run=config.run.name)
        self.events: list[str] = []
        self.sup = Supervisor(self.output_dir / "logs", on_event=self._on_event)
        self.threads = torch_threads(config)
        self.stop = asyncio.Event()
        self.wake = asyncio.Event()
        """Set when the status loop should look now, not at its next tick (an eval finished, a stop)."""
        self.stopped_because = "stopped"
        self.fatal: str | None = None
        self.secrets: dict[str, str] = {}
        """Environment only the children get (a Redis password that was in the URL)."""
        self.background: list[asyncio.Task] = []
        """The run's own tasks beside the status loop (metrics, eval); one that fails stops the run."""
        self.started = time.monotonic()
        self.metrics_last_id = "0"
        """The last metrics entry copied to metrics.jsonl."""
        self.tty = sys.stdout.isatty()
        self.exporter: Exporter | None = None
        self.plotting: asyncio.Future | None = None
        """The import of pyplot for report.png, started with the run."""

    # Events from the supervisor: shown in the status panel (or printed).

    def _on_event(self, event: str, info: dict) -> None:
        if event == "child_started" and not info["restarts"]:
            text = f"started {info['name']} (pid {info['pid']})"
        elif event == "child_started":
            text = f"restarted {info['name']} (pid {info['pid']}, restart #{info['restarts']})"
        elif event == "child_restarting":
            text = (f"{info['name']} exited with code {info['exit_code']}; restarting in {info['in_s']:.0f}s "
                    f"(see {info['log']})")
        elif event == "child_exited":
            text = f"{info['name']} exited with code {info['exit_code']}"
            if info["exit_code"] == CONFIG_EXIT_CODE and not self.sup.stopping:
                self.fatal = (f"{info['name']} failed on its config (exit code {CONFIG_EXIT_CODE}); "
                              f"see {info['log']}:\n" + _tail(info["log"]))
                self._request_stop()
        else:
            text = f"{event} {info}"
        self.events.append(f"{time.strftime('%H:%M:%S')} {text}")
        if not self.tty and not (event == "child_started" and not info["restarts"]):
            print(text, flush=True)

    # Start-up.

    def prepare_output(self) -> None:
        fresh = not (self.resume or self.attach)
        model = Path(self.config.model.path).resolve()
        for name in RUN_STATE if fresh else ():
            if model.is_relative_to((self.output_dir / name).resolve()):
                raise ConfigError(f"model.path={self.config.model.path!r} lies in this run's {name}/, which a "
                                  "fresh run clears; give this stage its own run.output_dir (or resume with --resume)")
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if not fresh:
            return
        for name in RUN_STATE:
            path = self.output_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    def child_argv(self, role: str, *options: str) -> list[str]:
        return [sys.executable, "-m", "workers.cli", role, "@", str(self.resolved_path), *options]

    def child_env(self) -> dict[str, str]:
        threads = str(self.threads)
        path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **self.secrets}

    async def start_redis(self) -> str:
        """The private redis-server, with a fresh random password: in ``redis/password`` (0600, named as
        ``redis.password_file`` in the config the children read) and ``redis/redis.conf`` (0600, so it is not in
        the server's command line)."""
        binary = redis_binary()
        port, data_dir = free_port(), (self.output_dir / "redis").resolve()
        data_dir.mkdir(parents=True, exist_ok=True)
        password = secrets.token_urlsafe(32)
        write_secret(data_dir / "password", password + "\n")
        write_secret(data_dir / "redis.conf", f"requirepass {password}\n")
        argv = redis_server_argv(binary, port, data_dir, conf=data_dir / "redis.conf")
        self.sup.start(ChildSpec("redis", "redis", argv, stop_order=2))
        self.config.redis.password_file = str(data_dir / "password")
        url = f"redis://127.0.0.1:{port}/0"
        await self._wait(lambda: redis_answers(url, password), "redis-server", 30.0, "redis")
        return url

    def secure_envs(self) -> None:
        """Env servers at ``tcp://`` addresses and no ``rollout.curve_dir``: CURVE keys for the run in
        ``OUTPUT_DIR/curve`` (made once; the servers started with them keep matching), which the run's workers use."""
        addresses = [e.address or "" for e in [*self.config.env, *self.config.eval.env]]
        if self.config.rollout.curve_dir is not None or not any(a.startswith("tcp://") for a in addresses):
            return
        folder = curve.generate((self.output_dir / "curve").resolve())
        self.config.rollout.curve_dir = str(folder)
        print(f"env servers on tcp://: start each with `rlbus env ... --curve-dir {folder}`", flush=True)

    def init_model(self) -> None:
        path = Path(self.config.model.path)
        if path.exists() or self.config.model.init_preset is None or is_hub_id(str(path)):
            return
        argv = [sys.executable, "-m", "workers.cli", "init-model", "--out", str(path),
                "--preset", self.config.model.init_preset, "--seed", str(self.config.run.seed)]
        self.log.info("model_init", path=str(path), preset=self.config.model.init_preset)
        done = subprocess.run(argv, env={**os.environ, **self.child_env()}, capture_output=True, text=True)
        if done.returncode != 0:
            raise RlbusError(f"init-model for {path} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")

    def inference_ports(self) -> tuple[list[int], list[int]]:
        """Ports of the inference servers and of the teacher server this run starts (port, port+1, …)."""
        ports = [] if self.config.inference.base_urls or self.attach else [
            self.config.inference.port + i for i in range(self.config.inference.servers)]
        own_teacher = needs_teacher_server(self.config) and not self.attach
        teacher = [self.config.inference.port + len(ports)] if own_teacher else []
        for port in ports + teacher:
            if not port_free(self.config.inference.host, port):
                raise ConfigError(
                    f"inference.port {port} is in use on {self.config.inference.host}; "
                    f"pass --inference.port N with {len(ports) + len(teacher)} free ports from N"
                )
        return ports, teacher

    async def start_workers(self, ports: list[int], teacher_ports: list[int]) -> None:
        env = self.child_env()
        servers = [(f"inference-{i}", "inference", port, ()) for i, port in enumerate(ports)]
        # The teacher: the same server on the teacher's weights, not following `weights` (no redis.url).
        servers += [("teacher", "teacher", port, ("--model.path", self.config.teacher.path, "--model.dtype",
                                                  self.config.teacher.dtype, "--redis.url", "none"))
                    for port in teacher_ports]
        for name, role, port, extra in servers:
            argv = self.child_argv("inference", "--port", str(port), "--server-id", name, *extra)
            await asyncio.to_thread(self.sup.start, ChildSpec(name, role, argv, env, stop_order=1, forkable=True))
        # stop_order: feeder and rollouts stop first (rollouts drain against live servers), redis last.
        # Every worker but the feeder starts beside the servers, so their start-ups (imports, env servers, the
        # rollout's tokenizer) share the cores with the servers' instead of following them; the feeder once every
        # server answers, so the first tasks find a server (a rollout worker would hold them, backing off).
        specs = [(f"filter-{i}", "filter", ["--consumer", f"filter-{i}"], 1) for i in range(self.config.filter.workers)]
        specs += [("packer", "packer", [], 1), ("trainer", "trainer", [], 1)]
        specs += [(f"rollout-{i}", "rollout", ["--consumer", f"rollout-{i}"], 0)
                  for i in range(self.config.rollout.workers)]
        await asyncio.to_thread(self._start, specs, env)
        host = self.config.inference.host
        for name, _, port, _ in servers:
            url = f"http://{host}:{port}/health"
            await self._wait(lambda u=url: _http_ok(u), f"{name} at {url}", self.health_timeout_s, name)
        await asyncio.to_thread(self._start, [("feeder", "feeder", [], 0)], env)

    def _start(self, specs: list[tuple[str, str, list[str], int]], env: dict[str, str]) -> None:
        """Start each ``(name, role, options, stop_order)`` as a supervised child."""
        for name, role, options, order in specs:
            self.sup.start(ChildSpec(name, role, self.child_argv(role, *options), env, stop_order=order, forkable=True))

    async def _wait(self, ready, what: str, timeout_s: float, child: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(ready):
            self.sup.poll()
            if self.stop.is_set():
                raise RlbusError(f"stopped while waiting for {what}")
            if time.monotonic() > deadline:
                raise RlbusError(f"{what} not ready after {timeout_s:.0f}s; see {self.sup.log_path(child)}:\n"
                                 + _tail(self.sup.log_path(child)))
            await asyncio.sleep(0.1)

    # The run.

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._signal)
        check_has_env(self.config)
        check_wandb(self.config)
        self.eval_sizes = await asyncio.to_thread(check_envs, self.config)
        check_models(self.config)
        self.prepare_output()
        bus, fork_server = None, None
        try:
            fork_server = None if self.attach else ForkServer(self.sup, self.config, self.child_env())
            # pyplot for report.png (~0.4 s), while the fork server's preload leaves the other core idle
            self.plotting = asyncio.ensure_future(asyncio.to_thread(pyplot))
            if self.attach:
                if not self.config.redis.url:
                    raise ConfigError("--attach needs redis.url (the Redis of the run to watch)")
                redis_url = self.config.redis.url
            else:
                redis_url = self.config.redis.url or await self.start_redis()
            bus = await Bus.connect(redis_url, self.config.run.name, self.config.redis, worker="run")
            await self._check_fresh(bus)
            ports, teacher_ports = self.inference_ports()
            host = self.config.inference.host
            self.secrets = child_password(self.config, redis_url)
            self.secure_envs()
            data = resolve(self.config, redis_url=redis_url, base_urls=[f"http://{host}:{p}/v1" for p in ports],
                           threads=self.threads, teacher_urls=[f"http://{host}:{p}/v1" for p in teacher_ports])
            self.resolved_path = self.output_dir / "config.resolved.toml"
            self.resolved_path.write_text(dump_toml(data))
            self.start_exporter(redis_url)
            evaluator = await self.start_eval(bus)
            if not self.attach:
                await asyncio.to_thread(self.init_model)
                await self.start_workers(ports, teacher_ports)
            return await self.watch(bus, evaluator)
        except (ConfigError, RlbusError) as e:
            self.fatal = self.fatal or str(e)
            print(f"rlbus run: {self.fatal}", file=sys.stderr)
            return CONFIG_EXIT_CODE if isinstance(e, ConfigError) else 1
        finally:
            await asyncio.to_thread(self.sup.stop_all, self.grace_s)
            if fork_server is not None:
                fork_server.close()
            if self.exporter is not None:  # its follower's blocked read ends with Redis
                await asyncio.to_thread(self.exporter.stop)
            if bus is not None:
                await bus.close()

    def _signal(self) -> None:
        if self.stop.is_set():
            self.grace_s = 1.0  # a second Ctrl-C: stop now
        self.stopped_because = "signal"
        self._request_stop()

    def _request_stop(self) -> None:
        self.stop.set()
        self.wake.set()

    async def _check_fresh(self, bus: Bus) -> None:
        if self.resume or self.attach or not self.config.redis.url:
            return
        _, keys = await bus.redis.scan(0, match=bus.keys.pattern(), count=1000)
        if keys:
            raise ConfigError(
                f"run {self.config.run.name!r} already has keys in {redact(self.config.redis.url)}; pass --resume to "
                "continue it, or choose another run.name"
            )

    def start_exporter(self, redis_url: str) -> None:
        """Serve the run's Prometheus metrics on ``exporter.port`` (a free port when that one is taken) and print
        where."""
        cfg = self.config.exporter
        if not cfg.in_run:
            return
        self.exporter = Exporter(self.config, redis_url, restarts=self.sup.restarts_by_role)
        try:
            port = self.exporter.start(cfg.port, cfg.host)
        except OSError:  # in use (another run on this machine)
            port = self.exporter.start(0, cfg.host)
        print(f"metrics: http://{cfg.host}:{port}/metrics (Prometheus)", flush=True)

    async def start_eval(self, bus: Bus):
        """The eval coordinator (None without [[eval.env]]); sets the first eval hold before any server starts."""
        if not self.config.eval.env:
            return None
        evaluator = EvalCoordinator(self.config, bus, self.eval_sizes)
        await evaluator.setup()
        return evaluator

    async def watch(self, bus: Bus, evaluator) -> int:
        probe = RunProbe(self.config, bus)
        writer = MetricsWriter(self.output_dir, self.config.run.name, self.config.wandb, wandb_config(self.config))
        self.metrics_last_id = writer.last_id
        for row in writer.rows:  # an earlier session's rows, which the stream may no longer hold
            probe.observe(row)
        tasks = [asyncio.create_task(self._follow_metrics(bus, writer, probe), name="metrics"),
                 asyncio.create_task(self._supervise(), name="supervisor")]
        if evaluator is not None:
            tasks.append(asyncio.create_task(evaluator.run(on_finished=self.wake.set), name="eval"))
        self.background = tasks
        try:
            await self._loop(bus, probe, evaluator)
        finally:
            await cancel_and_wait(tasks, BACKGROUND_STOP_S, self.log)
        await self._stop_workers()
        while await self._read_metrics(bus, writer, probe, block_ms=None):  # what came in before the workers stopped
            pass
        try:
            return await self.finish(bus, probe, writer.rows, await self._settled_counts(bus, writer, probe))
        finally:
            writer.close(report=self.output_dir / "report.png")

    async def _stop_workers(self) -> None:
        """Stop the workers (redis, stop_order 2, stays up for the summary's counts); meanwhile close the exporter's
        HTTP server (up to 0.5 s), which would otherwise follow."""
        stops = [asyncio.to_thread(self.exporter.stop_serving)] if self.exporter is not None else []
        if not self.attach:
            stops.append(asyncio.to_thread(self.sup.stop_all, self.grace_s, 1))
        await asyncio.gather(*stops)
        await asyncio.gather(self.plotting, return_exceptions=True)  # a failed import fails write_report, which says so

    async def _loop(self, bus: Bus, probe, evaluator) -> None:
        max_steps = self.config.run.max_steps
        done_at: float | None = None
        last_line_step = -1
        live = Live(console=Console(), refresh_per_second=4, transient=False) if self.tty else None
        reporter = StatusReporter(self.config.status.log_interval_seconds, self.config.status.ewa_alpha)
        if live is not None:
            live.start()
        try:
            while not self.stop.is_set():
                snap = await probe.snapshot()
                snap.restarts = self.sup.restarts_by_role()
                snap.events = self.events
                if live is not None:
                    live.update(render(snap, f"rlbus run {self.config.run.name}"))
                else:
                    if snap.trained != last_line_step:
                        reporter.observe(snap)
                        print(reporter.step_line(snap), flush=True)
                        last_line_step = snap.trained
                    if reporter.block_due(snap):
                        print(reporter.block(snap), flush=True)
                failed = self._failed_background()
                if failed:
                    self.fatal, self.stopped_because = failed, "error"
                    break
                reason = await bus.state_get(STOP_REASON_FIELD)
                if reason == DATA_EXHAUSTED:
                    last = await exhausted_at(bus, self.config.feeder.max_epochs)
                    if last is not None and snap.trained >= last:  # the last partial step is trained
                        self.stopped_because = DATA_EXHAUSTED
                        break
                elif reason:
                    self.fatal, self.stopped_because = reason, "stop_reason"
                    break
                if max_steps is not None and snap.trained >= max_steps:
                    done_at = done_at or time.monotonic()
                    eval_pending = evaluator is not None and not evaluator.complete(max_steps)
                    if not eval_pending or time.monotonic() - done_at > 300:
                        self.stopped_because = "max_steps"
                        break
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=0.5)
                except TimeoutError:
                    pass
                self.wake.clear()
        finally:
            if live is not None:
                live.stop()

    async def _supervise(self) -> None:
        """Restart failed children every 0.3 s, whatever the status loop is waiting on (a Redis that is down and
        being retried is itself one of the children to restart)."""
        while True:
            self.sup.poll()
            await asyncio.sleep(0.3)

    async def _follow_metrics(self, bus: Bus, writer, probe) -> None:
        while True:
            if await self._read_metrics(bus, writer, probe, block_ms=1000):
                await asyncio.sleep(READ_PAUSE_S)  # the rows of a moment in one read

    async def _read_metrics(self, bus: Bus, writer, probe, block_ms: int | None) -> int:
        """Copy the metrics entries after ``metrics_last_id`` to the writer and the probe; returns how many."""
        entries = await bus.read_fanout(bus.keys.metrics(), self.metrics_last_id, count=500, block_ms=block_ms,
                                       replicated=True)  # a row kept is one a failover cannot take back
        for entry_id, message in entries:
            if isinstance(message, Metric):
                probe.observe(writer.write(entry_id, message))
            self.metrics_last_id = entry_id  # with the write: a cancelled reader never leaves a row to repeat
        return len(entries)

    def _failed_background(self) -> str | None:
        """What went wrong in a background task (metrics, eval) that ended; None while they all run."""
        for task in self.background:
            if task.done() and not task.cancelled() and task.exception() is not None:
                error = task.exception()
                return f"the run's {task.get_name()} task failed: {type(error).__name__}: {error}"
        return None

    async def _settled_counts(self, bus: Bus, writer, probe) -> dict[str, int]:
        """The group counts of one consistent moment. With --attach the workers still run, and a group committed
        (its stream entry with its metrics row) between reading the metrics and counting the streams would be
        counted in flight but not produced: count again until no metrics row came in while counting."""
        for _ in range(SETTLE_TRIES):
            trained = (await probe.snapshot()).trained
            counts = await group_counts(bus, self.config, writer.rows, trained)
            if not await self._read_metrics(bus, writer, probe, block_ms=None):
                break
        return counts

    async def finish(self, bus: Bus, probe, rows: list[dict], groups: dict[str, int]) -> int:
        snap = await probe.snapshot()
        summary = build_summary(
            rows, run=self.config.run.name, steps_trained=snap.trained, max_steps=self.config.run.max_steps,
            wall_s=time.monotonic() - self.started, groups=groups,
            restarts=self.sup.restarts_by_role(), stopped_because=self.stopped_because,
        )
        if self.fatal:
            summary["error"] = self.fatal
        if self.config.bench:
            summary["bench"] = bench_numbers(rows)
        write_summary(summary, self.output_dir)
        try:
            write_report(rows, self.output_dir, title=f"rlbus run {self.config.run.name}")
        except Exception as e:  # the report is a convenience; the summary is what counts
            self.log.error("report_failed", error=str(e))
        print(summary_text(summary, self.output_dir), flush=True)
        if self.fatal:
            print(f"rlbus run: {self.fatal}", file=sys.stderr)
            return 1
        return 0


def _tail(path: Path | str, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
