"""Async OpenAI-compatible client over one or more inference servers (built-in or vLLM).

Requests go round-robin over ``base_urls``; a group of samples is pinned to one server by passing
``server_index=client.pick_server()`` to each call. Connection errors, timeouts, 429 and 5xx are
retried with exponential backoff (on the next server after the first retry); other 4xx fail at once
(401/403 as :class:`InferenceAuthError`, a configuration error).

When every retry fails the servers are down, not the request bad: :class:`InferenceUnavailableError`, which a
caller waits out with :class:`OutageHold` (the rollout worker holds its task) instead of failing the task.
"""

import asyncio
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from bus.errors import ConfigError, RetryableError, RlbusError
from workers.config import RlbusConfig


class InferenceRequestError(RlbusError):
    """The server rejected the request (4xx); retrying will not help."""


class InferenceAuthError(InferenceRequestError, ConfigError):
    """The server refused the API key (401/403): every request will fail alike until the key is fixed."""


class InferenceUnavailableError(RetryableError):
    """No server answered after every retry."""


HOLD_FIRST_S = 1.0
"""First wait of an :class:`OutageHold` (doubled per failed try)."""
HOLD_MAX_S = 10.0
"""Longest wait between two tries of an :class:`OutageHold` (a recovered server is found within this)."""


class OutageHold:
    """Waiting out servers that do not answer: backoff from :data:`HOLD_FIRST_S` doubling to :data:`HOLD_MAX_S`, a
    ``{what}_unreachable`` event per wait and ``{what}_recovered`` once they answer, with the time held (``what`` is
    ``inference`` or ``env``)."""

    def __init__(self, log: Any, what: str = "inference"):
        self.log = log
        self.what = what
        self.waits = 0
        self._since: float | None = None
        self._until: float | None = None

    @property
    def held_s(self) -> float:
        """Seconds from the first failure to the recovery (or now; 0 when none)."""
        if self._since is None:
            return 0.0
        return (self._until or asyncio.get_running_loop().time()) - self._since

    async def wait(self, error: Exception, stop: asyncio.Event) -> bool:
        """Wait before the next try; False when ``stop`` came first."""
        if self._since is None:
            self._since = asyncio.get_running_loop().time()
        delay = min(HOLD_MAX_S, HOLD_FIRST_S * 2**self.waits)
        self.waits += 1
        self.log.warning(f"{self.what}_unreachable", waits=self.waits, held_s=round(self.held_s, 1), retry_in_s=delay,
                         error=str(error)[:300])
        try:
            await asyncio.wait_for(stop.wait(), timeout=delay)
            return False
        except TimeoutError:
            return True

    def recovered(self) -> None:
        """The servers answered again (the held time stops here)."""
        if self.waits:
            self._until = asyncio.get_running_loop().time()
            self.log.info(f"{self.what}_recovered", held_s=round(self.held_s, 1), waits=self.waits)


@dataclass
class CompletionChoice:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str = ""


@dataclass
class CompletionResult:
    choices: list[CompletionChoice]
    prompt_token_ids: list[int]
    prompt_logprobs: list[float | None] = field(default_factory=list)
    """Logprob of each prompt token given the ones before (None for the first); empty unless asked."""
    policy_version: int | None = None
    """Weights version that started the generation (None from servers that do not report it, e.g. vLLM)."""
    policy_version_end: int | None = None


class InferenceClient:
    """One aiohttp session over ``base_urls`` (each like ``http://host:port/v1``)."""

    def __init__(self, base_urls: list[str], timeout_s: float = 300.0, max_retries: int = 3,
                 api_key_var: str | None = None, headers_from_env: dict[str, str] | None = None,
                 backoff_s: float = 0.5, model: str | None = None,
                 adapter: Callable[[], tuple[int, str | None]] | None = None):
        if not base_urls:
            raise ConfigError("the inference client has no server: set inference.base_urls (or inference.servers)")
        self.base_urls = [u.rstrip("/") for u in base_urls]
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.headers = _headers(api_key_var, headers_from_env or {})
        self._next = itertools.cycle(range(len(self.base_urls)))
        self._session: aiohttp.ClientSession | None = None
        self.model = model
        """The model name sent with every request; None: each server's first ``/v1/models`` entry."""
        self.adapter = adapter
        """LoRA on vLLM: (policy version, its adapter's name, None for the base model) to ask for now; a completion
        without a ``policy_version`` of its own is stamped with that version."""
        self._model_names: dict[int, str] = {}

    @classmethod
    def from_config(cls, config: RlbusConfig) -> "InferenceClient":
        cfg = config.inference
        return cls(config.inference_urls(), cfg.request_timeout_s, cfg.max_retries, cfg.api_key_var,
                   cfg.headers_from_env)

    def pick_server(self) -> int:
        """The next server index, round-robin (pin a group's requests to it)."""
        return next(self._next)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "InferenceClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def completions(self, prompt_token_ids: list[int], *, n: int = 1, temperature: float | None = None,
                          top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
                          max_tokens: int | None = None, stop: list[str] | None = None, seed: int | None = None,
                          logprobs: bool = True, prompt_logprobs: bool = False, server_index: int | None = None,
                          reasoning_effort: str | None = None,
                          extra_body: dict[str, Any] | None = None) -> CompletionResult:
        """Sample ``n`` completions of a token-id prompt; token ids and logprobs come back per choice. A sampling
        knob left None is not sent (the server's default applies)."""
        index = self.pick_server() if server_index is None else server_index
        version, adapter = self.adapter() if self.adapter is not None else (None, None)
        body: dict[str, Any] = {
            "model": adapter or await self._model_name(index), "prompt": list(prompt_token_ids), "n": n,
            "temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
            "reasoning_effort": reasoning_effort,
            "max_tokens": max_tokens, "stop": stop or None, "seed": seed, "return_token_ids": True,
            "logprobs": 0 if logprobs else None, "prompt_logprobs": 0 if prompt_logprobs else None,
            **(extra_body or {}),
        }
        # max_tokens stays even when None: null means "until EOS or the context limit" (absent means 16).
        sent = {k: v for k, v in body.items() if v is not None or k == "max_tokens"}
        data = await self.post("/completions", sent, index)
        if version is not None and data.get("policy_version") is None:
            data = {**data, "policy_version": version, "policy_version_end": version}
        return _parse_completion(data, prompt_token_ids)

    async def chat(self, messages: list[dict[str, str]], *, server_index: int | None = None,
                   **fields: Any) -> dict[str, Any]:
        """A raw chat completion (response JSON) for callers that want text."""
        index = self.pick_server() if server_index is None else server_index
        body = {"model": await self._model_name(index), "messages": messages, **fields}
        return await self.post("/chat/completions", body, index)

    async def post(self, path: str, body: dict[str, Any], server_index: int) -> dict[str, Any]:
        """POST with retries: the pinned server first, then the following ones."""
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            url = self.base_urls[(server_index + max(0, attempt - 1)) % len(self.base_urls)] + path
            try:
                return await self._post_once(url, body)
            except (aiohttp.ClientError, TimeoutError, RetryableError) as e:
                last = e
            if attempt < self.max_retries:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise InferenceUnavailableError(f"POST {path} failed after {self.max_retries + 1} tries "
                                        f"(servers {self.base_urls}): {last}") from last

    async def _post_once(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        session = self._get_session()
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
            if resp.status == 429 or resp.status >= 500:
                raise RetryableError(f"{url} answered {resp.status}: {(await resp.text())[:300]}")
            if resp.status in (401, 403):
                raise InferenceAuthError(f"{url} refused the API key ({resp.status}); set inference.api_key_var to the "
                                         f"variable holding the server's key: {(await resp.text())[:300]}")
            if resp.status >= 400:
                raise InferenceRequestError(f"{url} rejected the request ({resp.status}): {(await resp.text())[:500]}")
            return await resp.json(loads=msgspec.json.decode)

    async def model_name(self, index: int) -> str:
        """The model name requests to server ``index`` carry (see :meth:`_model_name`)."""
        return await self._model_name(index)

    async def _model_name(self, index: int) -> str:
        """The served model id of server ``index`` (vLLM checks it), asked once; ``model`` when set."""
        if self.model is not None:
            return self.model
        if index not in self._model_names:
            url = self.base_urls[index % len(self.base_urls)] + "/models"
            for attempt in range(self.max_retries + 1):
                try:
                    async with self._get_session().get(url, timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                        if 400 <= r.status < 500 and r.status != 429:
                            raise InferenceRequestError(f"{url} refused to list its models ({r.status}): "
                                                        f"{(await r.text())[:300]}")
                        r.raise_for_status()
                        self._model_names[index] = (await r.json())["data"][0]["id"]
                        break
                except (aiohttp.ClientError, TimeoutError) as e:
                    if attempt == self.max_retries:
                        raise InferenceUnavailableError(f"GET {url} failed: {e}") from e
                    await asyncio.sleep(self.backoff_s * 2**attempt)
        return self._model_names[index]

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self.headers,
                                                  connector=aiohttp.TCPConnector(limit=0))
        return self._session


def api_key(var: str | None) -> str | None:
    """The API key in environment variable ``var`` (``inference.api_key_var``; None: no key), for the clients that
    send it and the servers that ask for it."""
    if not var:
        return None
    key = os.environ.get(var)
    if not key:
        raise ConfigError(f"inference.api_key_var={var!r} is not set (or empty) in the environment; export the key "
                          "there, or unset inference.api_key_var to go without one")
    return key


def _headers(api_key_var: str | None, headers_from_env: dict[str, str]) -> dict[str, str]:
    headers = {}
    key = api_key(api_key_var)
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    for name, var in headers_from_env.items():
        value = os.environ.get(var)
        if value is None:
            raise ConfigError(f"inference.headers_from_env[{name!r}] reads ${var}, which is not set; export it")
        headers[name] = value
    return headers


def _parse_completion(data: dict[str, Any], prompt_token_ids: list[int]) -> CompletionResult:
    """Read a completions response of the built-in server or vLLM (token ids and logprobs per choice)."""
    choices = []
    for c in sorted(data["choices"], key=lambda c: c["index"]):
        lps = (c.get("logprobs") or {}).get("token_logprobs") or []
        choices.append(CompletionChoice([int(t) for t in c.get("token_ids") or []], [float(x) for x in lps],
                                        c.get("finish_reason") or "stop", c.get("text") or ""))
    first = data["choices"][0] if data["choices"] else {}
    prompt_ids = first.get("prompt_token_ids") or data.get("prompt_token_ids") or list(prompt_token_ids)
    raw = first.get("prompt_logprobs") or data.get("prompt_logprobs")
    prompt_lps: list[float | None] = []
    if raw:
        for token, entry in zip(prompt_ids, raw, strict=False):
            prompt_lps.append(None if entry is None else float(entry[str(token)]["logprob"]))
    return CompletionResult(choices, list(prompt_ids), prompt_lps, data.get("policy_version"),
                            data.get("policy_version_end"))
