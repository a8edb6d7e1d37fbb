"""What stands between the built-in server's routes and its clients: the API key, and the counts of what it refused.

API key (vLLM's ``--api-key`` convention): with ``inference.api_key_var`` set, the key is read from that environment
variable (never from the TOML) and every ``/v1/*`` request must carry ``Authorization: Bearer KEY``, else 401.
``/health`` stays open: supervisors (``rlbus run``, Kubernetes probes, ``InferenceProcess``) probe it without a key,
and it reveals no example or answer.

Counts: every refusal and failure is counted by name (:data:`COUNTED`); ``/health`` shows the totals, and
:class:`CountsReporter` publishes what changed as ``inference/<name>`` values of a ``Metric(source="inference")``
entry every :data:`REPORT_S`, with one ``inference_counts`` log event, so a flood of bad requests is one line per
interval, not one per request.
"""

import asyncio
import hmac
from collections import Counter
from collections.abc import Callable
from typing import Any

from aiohttp import web

from bus.messages import Metric
from workers.inference.openai_api import error_body

COUNTED = ("rejected_bad_request", "rejected_unauthorized", "rejected_overloaded", "rejected_engine_stopped",
           "engine_step_failed", "requests_disconnected", "weights_load_failed")
"""What the server counts (``inference/<name>`` in the metrics stream, ``counts`` in ``/health``)."""
REPORT_S = 5.0
"""How often changed counts are published to the metrics stream."""
OPEN_PATHS = ("/health",)
"""Paths served without the API key."""


class Counts:
    """Named event counts since start, and the change since the last report."""

    def __init__(self) -> None:
        self.totals: Counter[str] = Counter(dict.fromkeys(COUNTED, 0))
        self._reported: Counter[str] = Counter()

    def add(self, name: str, count: int = 1) -> None:
        self.totals[name] += count

    def delta(self) -> dict[str, int]:
        """Counts that grew since the last call, by how much."""
        changed = {k: v - self._reported[k] for k, v in self.totals.items() if v != self._reported[k]}
        self._reported = Counter(self.totals)
        return changed


def auth_middleware(key: str | None, counts: Counts, policy_version: Callable[[], int]):
    """An aiohttp middleware answering 401 to a ``/v1`` request without ``Authorization: Bearer <key>``."""
    expected = f"Bearer {key}".encode()

    @web.middleware
    async def check_key(request: web.Request, handler):
        if key is None or request.path in OPEN_PATHS:
            return await handler(request)
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            counts.add("rejected_unauthorized")
            body = error_body("missing or wrong API key: send 'Authorization: Bearer <key>' with the key in the "
                              "server's inference.api_key_var", 401, policy_version())
            return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check_key


class CountsReporter:
    """Publishes the change in :class:`Counts` to the run's metrics stream every :data:`REPORT_S` (when any)."""

    def __init__(self, counts: Counts, bus: Any, log, sources: Callable[[], dict[str, int]]):
        self.counts, self.log = counts, log
        self.bus = bus
        """The run's bus (None: counts only logged and shown in /health)."""
        self.sources = sources
        """Counts kept elsewhere (the engine's failed steps, the follower's failed loads), read as totals."""

    async def run(self) -> None:
        while True:
            await asyncio.sleep(REPORT_S)
            await self.report()

    async def report(self) -> None:
        for name, total in self.sources().items():
            self.counts.totals[name] = total
        changed = self.counts.delta()
        if not changed:
            return
        self.log.warning("inference_counts", **changed, totals=dict(self.counts.totals))
        if self.bus is not None:
            metric = Metric(source="inference", values={f"inference/{k}": float(v) for k, v in changed.items()})
            await self.bus.publish(self.bus.keys.metrics(), metric)
