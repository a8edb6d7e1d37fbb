"""``rlbus exporter @ config.toml``: a run's figures as Prometheus metrics, derived from Redis (the bus is the truth).

    rlbus exporter @ configs/default.toml --redis.url redis://… [--port 9400]
    curl -s localhost:9400/metrics | grep ^rlbus_

A deployment runs one per run (``rlbus run`` serves one itself, on ``exporter.port``). Each scrape reads the live
figures (streams, groups, lag, pending, the state hash, heartbeats); a background thread follows the streams every
``exporter.poll_s`` (:class:`workers.tools.run_follower.RunFollower`) for what accumulates (counters, histograms,
the newest rewards and trainer figures). Every metric is named ``rlbus_…`` in base units and carries the ``run``
label; docs/monitoring.md lists them.
"""

import argparse
import signal
import threading
import time
from collections.abc import Callable, Iterable

import redis
from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.core import Metric as PromMetric
from prometheus_client.registry import CollectorRegistry

from bus.clients import close_sync_client, sync_client
from bus.config import redact, redis_password
from bus.errors import ConfigError
from bus.keys import Keys
from bus.log import get_logger
from bus.observe import group_streams, heartbeat_ages, now_ms, state_fields, stream_length, stream_view
from bus.state import INFLIGHT_FIELD, LAST_STEP_FIELD, STOP_REASON_FIELD
from workers.config import RlbusConfig
from workers.tools.latency import Histogram
from workers.tools.run_follower import READ_PAUSE_S, RunFollower

TRAINER_GAUGES = {"step_time_s": ("trainer_step_seconds", "Duration of the last trained step."),
                  "tokens_per_s": ("trainer_tokens_per_second", "Tokens per second of the last trained step."),
                  "wait_s": ("trainer_idle_seconds", "Seconds the trainer waited for the last step's batch."),
                  "weights_s": ("trainer_weights_seconds",
                                "Seconds the last step waited on publishing weights (the step before's, then its own "
                                "copy; the write overlaps the next step).")}
"""Trainer metric value → (gauge name without the prefix, help)."""


class RunCollector:
    """The Prometheus collector of one run (registered in its own registry)."""

    def __init__(self, client: redis.Redis, config: RlbusConfig, restarts: Callable[[], dict[str, int]] | None = None):
        self.client = client
        self.config = config
        self.keys = Keys(config.run.name)
        self.run = config.run.name
        envs = {e.resolved_name for e in config.env} | {e.resolved_name for e in config.eval.env}
        self.follower = RunFollower(client, config.run.name, sorted(envs))
        self.restarts = restarts
        self.started_ms: int | None = None
        self.collect_s = 0.0
        self.collects = 0

    def collect(self) -> Iterable[PromMetric]:
        started = time.thread_time()
        families = self._live()
        with self.follower.lock:
            families += self._followed()
        self.collect_s += time.thread_time() - started
        self.collects += 1
        families.append(self._counter("exporter_collect_cpu_seconds", "CPU seconds this exporter spent answering "
                                      "scrapes.", [], [([], self.collect_s)]))
        return families

    # Families.

    def _family(self, kind, name: str, doc: str, labels: list[str], rows) -> PromMetric:
        family = kind(f"rlbus_{name}", doc, labels=["run", *labels])
        for values, value in rows:
            family.add_metric([self.run, *map(str, values)], value)
        return family

    def _gauge(self, name: str, doc: str, labels: list[str], rows) -> PromMetric:
        return self._family(GaugeMetricFamily, name, doc, labels, rows)

    def _counter(self, name: str, doc: str, labels: list[str], rows) -> PromMetric:
        return self._family(CounterMetricFamily, name, doc, labels, rows)

    def _histogram(self, name: str, doc: str, labels: list[str], rows: list[tuple[list, Histogram]]) -> PromMetric:
        family = HistogramMetricFamily(f"rlbus_{name}", doc, labels=["run", *labels])
        for values, hist in rows:
            family.add_metric([self.run, *map(str, values)], hist.buckets(), hist.total)
        return family

    def _live(self) -> list[PromMetric]:
        """Read now from Redis: streams and groups, the state hash, heartbeats."""
        at_ms = now_ms(self.client)
        self.started_ms = self.started_ms or at_ms
        views = [v for v in (stream_view(self.client, self.keys, k, at_ms)
                             for k in group_streams(self.client, self.keys))
                 if v is not None]
        groups = [((v.family, v.suffix, g.name), g) for v in views for g in v.groups]
        labels = ["stream", "env", "group"]
        state = state_fields(self.client, self.keys)
        beats = heartbeat_ages(self.client, self.keys.workers(), at_ms)
        servers = heartbeat_ages(self.client, self.keys.servers(), at_ms)
        follower = self.follower
        last_trained = follower.trained_at_ms or self.started_ms
        return [
            self._gauge("stream_length", "Entries in the stream.", ["stream", "env"],
                        [((v.family, v.suffix), v.length) for v in views]),
            self._gauge("dead_letter_stream_length", "Entries in the dead-letter stream.", [],
                        [([], stream_length(self.client, self.keys.dead()))]),
            self._gauge("group_lag", "Entries not yet delivered to the group.", labels,
                        [(k, g.lag) for k, g in groups if g.lag is not None]),
            self._gauge("group_pending", "Entries delivered to the group and not yet acked.", labels,
                        [(k, g.pending) for k, g in groups]),
            self._gauge("group_oldest_pending_age_seconds", "Age of the group's oldest pending entry (0: none).",
                        labels, [(k, g.oldest_pending_age_s) for k, g in groups]),
            self._gauge("group_pending_max_deliveries", "Highest delivery count among the oldest pending entries.",
                        labels, [(k, g.max_deliveries) for k, g in groups]),
            self._gauge("group_consumers", "Consumers of the group that read or acked within the last minute.",
                        labels, [(k, g.consumers) for k, g in groups]),
            self._counter("group_entries_read", "Entries the group has read over the stream's life.", labels,
                          [(k, g.entries_read) for k, g in groups if g.entries_read is not None]),
            self._gauge("run_finished", "1 once the run is over (trained run.max_steps, or a stop reason is set: "
                        "data exhausted, collapse), else 0.", [], [([], float(self._finished(state)))]),
            self._gauge("inflight_samples", "Samples issued by the feeder and not yet consumed by the packer.", [],
                        [([], float(state.get(INFLIGHT_FIELD, 0)))]),
            self._gauge("packer_last_step", "The last step the packer published.", [],
                        [([], float(state.get(LAST_STEP_FIELD, 0)))]),
            self._gauge("last_trained_age_seconds", "Seconds since the trainer last published a trained version "
                        "(since the exporter started, before the first).", [],
                        [([], max(0.0, (at_ms - last_trained) / 1000))]),
            self._gauge("worker_heartbeat_age_seconds", "Seconds since the worker's last heartbeat.",
                        ["worker", "host", "role"], [(_worker_labels(m), age) for m, age in beats.items()]),
            self._gauge("inference_server_heartbeat_age_seconds", "Seconds since the inference server's last "
                        "heartbeat.", ["server"], [([s], age) for s, age in servers.items()]),
        ]

    def _finished(self, state: dict[str, str]) -> bool:
        max_steps = self.config.run.max_steps
        return bool(state.get(STOP_REASON_FIELD)) or (max_steps is not None and self.follower.trained >= max_steps)

    def _followed(self) -> list[PromMetric]:
        """What the follower gathered from the streams."""
        out = [*self._versions_and_counts(), *self._latencies_and_results()]
        trainer = self.follower.latest.get("trainer", {})
        out += [self._gauge(name, doc, [], [([], trainer[key])] if key in trainer else [])
                for key, (name, doc) in TRAINER_GAUGES.items()]
        if self.restarts is not None:
            out.append(self._counter("worker_restarts", "Restarts of the workers `rlbus run` supervises.", ["role"],
                                     [([r], n) for r, n in self.restarts().items()]))
        return out

    def _versions_and_counts(self) -> list[PromMetric]:
        f = self.follower
        c = f.counters
        max_off = self.config.packer.max_off_policy_steps
        return [
            self._gauge("policy_trained_step", "The newest step the trainer published (policy version trained).", [],
                        [([], f.trained)]),
            self._gauge("policy_served_step", "The step each inference server serves.", ["server"],
                        [([s], v) for s, v in f.served.items()]),
            self._gauge("max_off_policy_steps", "packer.max_off_policy_steps: the staleness bound.", [],
                        [([], max_off)]),
            self._counter("groups", "Training groups by outcome: produced by rollouts, trained (packed), filtered "
                          "out, dropped as stale, duplicate, dead-lettered.", ["outcome"],
                          [([o], c[("groups", o)]) for o in ("produced", "trained", "filtered", "stale", "duplicate",
                                                             "dead")]),
            self._counter("dead_letters", "Dead letters by the stream they came from and their reason's first "
                          "word.", ["stream", "reason"], [(list(k), n) for k, n in f.dead.items()]),
            self._counter("tokens", "Tokens generated by rollouts, packed into steps, trained.", ["stage"],
                          [([s], c[("tokens", s)]) for s in ("generated", "packed", "trained")]),
            self._counter("trainer_idle_seconds", "Seconds the trainer waited for batches.", [],
                          [([], c[("seconds", "trainer_idle")])]),
            self._counter("trainer_busy_seconds", "Seconds the trainer spent in steps.", [],
                          [([], c[("seconds", "trainer_step")])]),
            self._counter("rollout_gate_wait_seconds", "Seconds rollouts waited on the staleness gate.", [],
                          [([], c[("seconds", "rollout_gate_wait")])]),
        ]

    def _latencies_and_results(self) -> list[PromMetric]:
        f = self.follower
        return [
            self._histogram("hop_latency_seconds", "Per-hop latency of a training sample (queued, generating, "
                            "filtering, packing, training).", ["hop"],
                            [([hop], h) for hop, h in f.latency.hops.items()]),
            self._histogram("trained_staleness_steps", "Steps each trained sample's policy is behind the policy its "
                            "step trains.", [], [([], f.latency.staleness)]),
            self._gauge("trained_staleness_max_steps", "Largest staleness in the last packed step.", [],
                        [([], f.latency.last_staleness_max)] if f.latency.last_staleness_max is not None else []),
            self._histogram("weight_update_latency_seconds", "Seconds from a step's trained version to a server "
                            "serving it.", ["server"], [([s], h) for s, h in f.weight_update.items()]),
            self._gauge("train_reward_mean", "Mean reward of the last packed step's samples.", [],
                        [([], v)] if (v := f.latest.get("packer", {}).get("packer/reward_mean")) is not None else []),
            self._gauge("eval_reward", "Mean reward of the newest eval.", ["env"],
                        [([e], v["reward"]) for e, v in f.eval.items() if "reward" in v]),
            self._gauge("eval_pass_at_1", "pass@1 of the newest eval.", ["env"],
                        [([e], v["pass@1"]) for e, v in f.eval.items() if "pass@1" in v]),
            self._gauge("eval_step", "The step of the newest eval.", ["env"],
                        [([e], v["step"]) for e, v in f.eval.items()]),
        ]


def _worker_labels(member: str) -> list[str]:
    worker, _, host = member.rpartition("@")
    return [worker, host, worker.split("-", 1)[0]]


class Exporter:
    """Serves one run's collector over HTTP and follows its streams from a thread, until :meth:`stop`."""

    def __init__(self, config: RlbusConfig, redis_url: str, restarts: Callable[[], dict[str, int]] | None = None):
        self.config = config
        self.client = sync_client(redis_url, password=redis_password(config.redis))
        self.collector = RunCollector(self.client, config, restarts)
        self.registry = CollectorRegistry()
        self.registry.register(self.collector)
        self.log = get_logger(worker="exporter", run=config.run.name)
        self._stop = threading.Event()
        self._server = None
        self._follow = threading.Thread(target=self._poll_loop, name="rlbus-exporter-follow", daemon=True)

    def start(self, port: int, host: str) -> int:
        """Listen on ``host:port`` (0: any free port) and start following; returns the port."""
        self._server, _ = start_http_server(port, host, registry=self.registry)
        self._follow.start()
        port = self._server.server_port
        self.log.info("exporter_started", host=host, port=port)
        return port

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                if self.collector.follower.poll(block_ms=int(self.config.exporter.poll_s * 1000)):
                    self._stop.wait(READ_PAUSE_S)
            except (redis.RedisError, OSError) as e:  # Redis away: the figures go stale, scrapes say so
                if not self._stop.is_set():  # (not the end of a run, whose Redis stops first)
                    self.log.warning("exporter_poll_failed", error=str(e))
                self._stop.wait(self.config.exporter.poll_s)

    def stop_serving(self) -> None:
        """Close the HTTP server (up to half a second: its poll) and tell the follower to end after its read."""
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def stop(self) -> None:
        self.stop_serving()
        if self._follow.is_alive():
            self._follow.join(timeout=5)
        close_sync_client(self.client)


def parse_args(argv: list[str], config: RlbusConfig) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rlbus exporter", description="Serve a run's figures to Prometheus.")
    parser.add_argument("--port", type=int, default=config.exporter.port, help="port (default: exporter.port)")
    parser.add_argument("--host", default=config.exporter.host, help="address (default: exporter.host)")
    return parser.parse_args(argv)


def main(config: RlbusConfig, argv: list[str]) -> int:
    args = parse_args(argv, config)
    if not config.redis.url:
        raise ConfigError("rlbus exporter needs redis.url (the Redis of the run to watch); pass --redis.url")
    exporter = Exporter(config, config.redis.url)
    try:
        exporter.client.ping()
    except redis.ConnectionError as e:
        raise ConfigError(f"cannot reach Redis at {redact(config.redis.url)}: {e}; check redis.url") from e
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    port = exporter.start(args.port, args.host)
    print(f"rlbus exporter: run {config.run.name} metrics at http://{args.host}:{port}/metrics", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        exporter.stop()
    return 0
