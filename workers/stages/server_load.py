"""The inference servers' load as adaptive concurrency reads it (:class:`Load`).

Each poll asks every server at once, each bounded by a timeout: the built-in server's ``/health`` (``queued``,
``active`` of ``max_batch_size``, ``decode_s`` over ``steps``), vLLM's Prometheus ``/metrics``
(``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` or ``vllm:gpu_cache_usage_perc``,
``vllm:num_preemptions_total``, ``vllm:inter_token_latency_seconds`` or ``vllm:time_per_output_token_seconds``).
A server's kind is found at its first answer (a JSON ``/health`` with ``queued`` is the built-in one). A server
that does not answer is left out; when none does, the poll is None (the controller holds).
"""

import asyncio
import json
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Load:
    """The inference servers' load at one poll (summed over the servers that answered; None: not reported)."""

    waiting: int | None = None
    """Requests (vLLM) or sequences (built-in) waiting for room in a running batch."""
    use: float | None = None
    """KV-cache use (vLLM) or batch-slot use (built-in), 0..1, the fullest server's."""
    preemptions: int = 0
    """Preemptions since the previous poll."""
    token_s: float | None = None
    """Seconds per generated token of a sequence (one decode step) since the previous poll, the slowest server's."""


VLLM_USE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
VLLM_PREEMPTIONS = ("vllm:num_preemptions_total", "vllm:num_preemptions")
VLLM_TOKEN_LATENCY = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")


@dataclass(frozen=True)
class Reading:
    """One server's answer: gauges, and counters whose change since its previous answer counts."""

    waiting: int | None
    use: float | None
    preemptions: float = 0.0
    decode_s: float | None = None
    steps: float | None = None


class ServerLoad:
    """Polls the servers of ``base_urls`` (``http://host:port/v1``)."""

    def __init__(self, base_urls: list[str], headers: dict[str, str], timeout_s: float):
        self.roots = [url.rstrip("/").removesuffix("/v1") for url in base_urls]
        self.headers = headers
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._builtin: dict[str, bool] = {}
        self._last: dict[str, Reading] = {}
        self._session: aiohttp.ClientSession | None = None

    async def poll(self) -> Load | None:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self.headers, timeout=self.timeout)
        answers = await asyncio.gather(*(self._read(root) for root in self.roots), return_exceptions=True)
        now = {root: a for root, a in zip(self.roots, answers, strict=True) if isinstance(a, Reading)}
        if not now:
            return None
        load = combine([(reading, self._last.get(root)) for root, reading in now.items()])
        self._last.update(now)
        return load

    async def _read(self, root: str) -> Reading:
        if self._builtin.get(root, True):
            async with self._session.get(f"{root}/health") as resp:
                body = await resp.text()
            health = _json(body) if resp.status == 200 else None
            if isinstance(health, dict) and "queued" in health:
                self._builtin[root] = True
                return from_health(health)
            if resp.status != 200:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
            self._builtin[root] = False
        async with self._session.get(f"{root}/metrics") as resp:
            resp.raise_for_status()
            return from_prometheus(await resp.text())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _json(body: str):
    try:
        return json.loads(body)
    except ValueError:
        return None


def from_health(health: dict) -> Reading:
    """The built-in server's ``/health``."""
    slots = health.get("max_batch_size")
    use = health["active"] / slots if slots else None
    return Reading(waiting=int(health["queued"]), use=use, decode_s=health.get("decode_s"), steps=health.get("steps"))


def from_prometheus(text: str) -> Reading:
    """vLLM's ``/metrics``: each sample summed over its label sets (engines, models)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value

    def first(names: tuple[str, ...], suffix: str = "") -> float | None:
        return next((values[n + suffix] for n in names if n + suffix in values), None)

    waiting = values.get("vllm:num_requests_waiting")
    return Reading(waiting=None if waiting is None else int(waiting), use=first(VLLM_USE),
                   preemptions=first(VLLM_PREEMPTIONS) or 0.0, decode_s=first(VLLM_TOKEN_LATENCY, "_sum"),
                   steps=first(VLLM_TOKEN_LATENCY, "_count"))


def combine(readings: list[tuple[Reading, Reading | None]]) -> Load:
    """The servers' load: waiting and preemptions summed, use and latency per token the worst server's."""
    waiting = [r.waiting for r, _ in readings if r.waiting is not None]
    uses = [r.use for r, _ in readings if r.use is not None]
    preemptions, latencies = 0, []
    for now, before in readings:
        if before is None:
            continue
        preemptions += max(0, int(now.preemptions - before.preemptions))
        if None not in (now.decode_s, now.steps, before.decode_s, before.steps) and now.steps > before.steps:
            latencies.append((now.decode_s - before.decode_s) / (now.steps - before.steps))
    return Load(waiting=sum(waiting) if waiting else None, use=max(uses) if uses else None, preemptions=preemptions,
                token_s=max(latencies) if latencies else None)
