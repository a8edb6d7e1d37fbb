"""``GET /metrics`` of the built-in inference server: its engine's figures in Prometheus's text format.

    rlbus_inference_queued_requests{run, server}          requests not yet in the running batch
    rlbus_inference_running_sequences{run, server}        sequences decoding now
    rlbus_inference_generated_tokens_total{run, server}   tokens sampled since the server started
    rlbus_inference_decode_steps_total{run, server}       decode forward passes
    rlbus_inference_prefills_total{run, server}           prefill forward passes
    rlbus_inference_policy_version{run, server}           the step whose weights it serves

vLLM serves its own ``/metrics`` (``vllm:num_requests_waiting``, ``vllm:num_requests_running``, …) on its port.
"""

from collections.abc import Iterable

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

CONTENT_TYPE = "text/plain; version=0.0.4"
"""Prometheus's text exposition format."""


class EngineCollector:
    """Reads an :class:`workers.inference.engine.Engine`'s counters at each scrape."""

    def __init__(self, engine, run: str, server: str):
        self.engine = engine
        self.labels = [run, server]

    def collect(self) -> Iterable[Metric]:
        e = self.engine
        rows = [(GaugeMetricFamily, "queued_requests", "Requests not yet in the running batch.", e.queued),
                (GaugeMetricFamily, "running_sequences", "Sequences decoding now.", e.active),
                (CounterMetricFamily, "generated_tokens", "Tokens sampled since the server started.",
                 e.generated_tokens),
                (CounterMetricFamily, "decode_steps", "Decode forward passes.", e.steps),
                (CounterMetricFamily, "prefills", "Prefill forward passes.", e.prefills),
                (GaugeMetricFamily, "policy_version", "The step whose weights it serves.", e.policy_version)]
        for kind, name, doc, value in rows:
            family = kind(f"rlbus_inference_{name}", doc, labels=["run", "server"])
            family.add_metric(self.labels, float(value))
            yield family


def registry_for(engine, run: str, server: str) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, run, server))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
