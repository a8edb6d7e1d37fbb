"""The built-in inference server (``inference.backend = "transformers"``): aiohttp over the dynamic-batching engine.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both also with ``"stream": true``: server-sent
events as the tokens are sampled), ``POST /inference/v1/generate`` (token ids in and out, :mod:`generate_api`),
``GET /v1/models``, ``GET /health``.
Every JSON response carries ``policy_version``. With ``redis.url`` set the server follows ``weights``
and publishes ``served``; without it, it serves the model at ``model.path`` as version 0.

Refusals: a parameter out of range is a 400 naming it (``error.param``); a full queue
(``inference.max_queued_sequences``) a 429 and a stopped engine a 503, both with ``Retry-After``; a failed engine
step a 500 (retry); a missing API key a 401 (:mod:`workers.inference.guard`). A client that disconnects frees its
batch rows at the next step. A weights update that fails to load leaves the last good weights serving.
"""

import argparse
import asyncio
import json
from typing import Any

import msgspec
import torch
from aiohttp import web
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from bus.log import get_logger
from bus.policy import server_stopped
from bus.weight_files import weights_root
from trainer.broadcast import receive_weights
from trainer.lora import load_adapter_into, read_adapter
from trainer.model import resolve_dtype
from trainer.weights import load_tensors_into, read_weights
from workers.config import RlbusConfig
from workers.inference import prometheus
from workers.inference.client import api_key
from workers.inference.engine import Engine
from workers.inference.engine_errors import BadRequest, EngineOverloaded, EngineStepFailed, EngineStopped
from workers.inference.generate_api import generate_request, generate_response
from workers.inference.guard import Counts, CountsReporter, auth_middleware
from workers.inference.openai_api import (
    ApiError,
    Renderer,
    chat_prompt,
    completion_prompts,
    error_body,
    sampling_params,
)
from workers.inference.streaming import DONE, ChunkWriter, TextDelta
from workers.inference.weights_follower import WeightsFollower
from workers.lifecycle import connect_bus, run_until_first, run_worker

RETRY_AFTER_S = 1
"""``Retry-After`` of a 429 (queue full) or 503 (engine stopped; the supervisor restarts the server)."""
REFUSED = {400: "rejected_bad_request", 429: "rejected_overloaded", 503: "rejected_engine_stopped"}
"""The count each refusal status adds to (a 500 is counted by the engine as a failed step)."""


class InferenceServer:
    """The built-in server: model + engine + HTTP routes + weights follower."""

    def __init__(self, config: RlbusConfig, host: str, port: int, server_id: str):
        self.config = config
        self.host, self.port, self.server_id = host, port, server_id
        self.log = get_logger(worker="inference", server=server_id, run=config.run.name)
        self.engine: Any = None
        self.renderer: Any = None
        self.bus: Any = None
        self.follower: Any = None
        self._runner: web.AppRunner | None = None
        self._registry = None
        self.counts = Counts()
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def setup(self) -> None:
        key = api_key(self.config.inference.api_key_var)  # before the model loads: a missing key fails at once
        self.engine = await asyncio.to_thread(self._build_engine)
        self.engine.start()
        self.renderer = Renderer(self.engine.tokenizer, self.config.model.path)
        if self.config.redis.url:
            await self._setup_follower()
        else:
            self.log.warning("weights_follow_disabled", reason="redis.url is not set; serving model.path as version 0")
        app = web.Application(client_max_size=64 * 1024 * 1024,
                              middlewares=[auth_middleware(key, self.counts, lambda: self.engine.policy_version)])
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/inference/v1/generate", self.generate),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
        ])
        # handler_cancellation: a client that disconnects cancels its handler, which frees the request's rows.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.log.info("server_ready", host=self.host, port=self.port, model=self.config.model.path,
                      policy_version=self.engine.policy_version, api_key=key is not None)

    def _build_engine(self):
        hf_logging.disable_progress_bar()
        cfg = self.config.inference
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = resolve_dtype(self.config.model.dtype, torch.device(device))
        tokenizer = AutoTokenizer.from_pretrained(self.config.model.path)
        model = AutoModelForCausalLM.from_pretrained(self.config.model.path, dtype=dtype).to(device).eval()
        eos = {tokenizer.eos_token_id} | set(_as_list(model.generation_config.eos_token_id))
        return Engine(model, tokenizer, max_batch_size=cfg.max_batch_size, max_model_len=cfg.max_model_len,
                      eos_token_ids={t for t in eos if t is not None}, max_queued=cfg.max_queued_sequences,
                      batch_wait_s=cfg.batch_wait_ms / 1000)

    async def _setup_follower(self) -> None:
        self.bus = await connect_bus(self.config, f"inference-{self.server_id}")
        self.follower = WeightsFollower(self.bus, self.server_id, self._apply_weights,
                                        weights_root(self.config.run.output_dir),
                                        block_ms=self.config.redis.block_ms,
                                        wait_for_weights_s=self.config.ckpt.wait_for_weights_timeout)
        await self.follower.start()

    async def _apply_weights(self, event) -> None:
        """Load one update in place between two decode steps; responses after it carry its step."""
        model = self.engine.model
        adapter = None
        if event.adapter is not None:
            adapter, tensors = await asyncio.to_thread(read_adapter, event.dir, "cpu")
        elif event.format == "safetensors":
            tensors = await asyncio.to_thread(read_weights, event.dir, "cpu")
        else:
            tensors = await asyncio.to_thread(receive_weights, event, "cpu")

        def load() -> None:
            if adapter is not None:
                load_adapter_into(model, adapter, tensors)
            else:
                load_tensors_into(model, tensors)
            self.engine.policy_version = event.step

        await asyncio.wrap_future(self.engine.call_between_steps(load))

    async def run(self) -> None:
        reporter = CountsReporter(self.counts, self.bus, self.log, self._counted_elsewhere)
        await run_until_first(self._stop, self._watch_engine(), reporter.run(),
                              *([self.follower.run()] if self.follower else []))

    def _counted_elsewhere(self) -> dict[str, int]:
        counts = {"engine_step_failed": self.engine.failures}
        if self.follower is not None:
            counts["weights_load_failed"] = self.follower.failed_loads
        return counts

    async def _watch_engine(self) -> None:
        while self.engine.alive:
            await asyncio.sleep(1.0)
        raise RuntimeError(f"inference engine stopped: {self.engine.error!r}")

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        if self.bus is not None:
            await server_stopped(self.bus, self.server_id)
            await self.bus.close()
        self.log.info("server_stopped")

    # Routes.

    async def completions(self, request: web.Request) -> web.StreamResponse:
        async def handle(body: dict) -> dict | web.StreamResponse:
            params = sampling_params(body, chat=False)
            prompts = completion_prompts(body, self.engine.tokenizer)
            if body.get("stream"):
                return await self._stream(request, body, prompts, params, chat=False)
            return self.renderer.completion(await self._generate(prompts, params), body)

        return await self._respond(request, handle)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        async def handle(body: dict) -> dict | web.StreamResponse:
            params = sampling_params(body, chat=True)
            prompt = chat_prompt(body, self.engine.tokenizer)
            if body.get("stream"):
                return await self._stream(request, body, [prompt], params, chat=True)
            return self.renderer.chat((await self._generate([prompt], params))[0], body)

        return await self._respond(request, handle)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        async def handle(body: dict) -> dict:
            prompt_ids, params = generate_request(body)
            (generation,) = await self._generate([prompt_ids], params)
            return generate_response(generation, self.config.model.path)

        return await self._respond(request, handle)

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.config.model.path, "object": "model", "owned_by": "rlbus",
                "max_model_len": self.config.inference.max_model_len}
        return web.json_response({"object": "list", "data": [card], "policy_version": self.engine.policy_version})

    async def metrics(self, request: web.Request) -> web.Response:
        if self._registry is None:
            self._registry = prometheus.registry_for(self.engine, self.config.run.name, self.server_id)
        return web.Response(body=prometheus.render(self._registry), headers={"Content-Type": prometheus.CONTENT_TYPE})

    async def health(self, request: web.Request) -> web.Response:
        ok = self.engine.alive
        return web.json_response({"status": "ok" if ok else "engine_dead", "policy_version": self.engine.policy_version,
                                  "active": self.engine.active, "queued": self.engine.waiting,
                                  "counts": {**self.counts.totals, **self._counted_elsewhere()},
                                  "steps": self.engine.steps, "decode_s": self.engine.decode_s,
                                  "max_batch_size": self.engine.max_batch_size,
                                  "prefills": self.engine.prefills,
                                  "generated_tokens": self.engine.generated_tokens}, status=200 if ok else 503)

    async def _stream(self, request: web.Request, body: dict, prompts: list[list[int]], params,
                      chat: bool) -> web.StreamResponse:
        """Server-sent events of every choice's text as the engine samples it (see :mod:`streaming`)."""
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue = asyncio.Queue()
        handles = self._submit(prompts, params, on_token=lambda p, j, t: (
            loop.call_soon_threadsafe(tokens.put_nowait, (p * params.n + j, t))))
        writer = ChunkWriter(self.config.model.path, chat, self.engine.policy_version)
        deltas = [TextDelta(self.engine.tokenizer, params.stop) for _ in range(len(prompts) * params.n)]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        done = asyncio.gather(*(asyncio.wrap_future(h.future) for h in handles))
        next_token: asyncio.Future | None = None
        try:
            for index in range(len(deltas)):
                await response.write(writer.start(index))
            while not (done.done() and tokens.empty()):
                next_token = asyncio.ensure_future(tokens.get())
                await asyncio.wait({next_token, done}, return_when=asyncio.FIRST_COMPLETED)
                if not next_token.done():
                    next_token.cancel()
                    continue
                index, token = next_token.result()
                if text := deltas[index].add(token):
                    await response.write(writer.text(index, text))
            gens = done.result()
            choices = [c for gen in gens for c in gen.choices]
            for index, choice in enumerate(choices):
                await response.write(writer.text(index, deltas[index].finish(choice), finish=choice))
            if (body.get("stream_options") or {}).get("include_usage"):
                await response.write(writer.usage(sum(len(g.prompt_token_ids) for g in gens),
                                                  sum(len(c.token_ids) for c in choices)))
            await response.write(DONE)
        except (ConnectionResetError, asyncio.CancelledError):
            self._client_gone(handles)
            done.cancel()
            if next_token is not None:
                next_token.cancel()
            raise
        return response

    def _submit(self, prompts: list[list[int]], params, on_token=None) -> list:
        """Queue every prompt of a request, or refuse it whole (400, 429 or 503)."""
        try:
            return self.engine.submit_all(prompts, params, on_token)
        except BadRequest as e:
            raise ApiError(str(e), param=e.param) from e
        except EngineOverloaded as e:
            raise ApiError(str(e), 429, headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except EngineStopped as e:
            raise ApiError(str(e), 503, headers={"Retry-After": str(RETRY_AFTER_S)}) from e

    async def _generate(self, prompts: list[list[int]], params) -> list:
        """Every prompt's generation; a failed engine step is a 500 (retry), a stopped engine a 503."""
        handles = self._submit(prompts, params)
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(h.future) for h in handles)))
        except asyncio.CancelledError:
            self._client_gone(handles)
            raise
        except EngineStepFailed as e:
            raise ApiError(str(e), 500) from e
        except RuntimeError as e:  # the engine stopped while the request waited
            raise ApiError(str(e), 503, headers={"Retry-After": str(RETRY_AFTER_S)}) from e

    def _client_gone(self, handles: list) -> None:
        """The client went away: its rows leave the batch at the next step."""
        for handle in handles:
            handle.cancelled = True
        self.counts.add("requests_disconnected")
        self.log.info("request_disconnected", sequences=sum(h.params.n for h in handles))

    async def _respond(self, request: web.Request, handle) -> web.Response:
        try:
            body = await request.json(loads=_json_value)
            if not isinstance(body, dict):
                raise ApiError("the request body must be a JSON object")
            out = await handle(body)
            return out if isinstance(out, web.StreamResponse) else web.json_response(out, dumps=_json_text)
        except json.JSONDecodeError as e:
            self.counts.add("rejected_bad_request")
            return web.json_response(error_body(f"invalid JSON body: {e}", 400, self.engine.policy_version), status=400)
        except ApiError as e:
            if e.status in REFUSED:
                self.counts.add(REFUSED[e.status])
            self.log.debug("request_refused", status=e.status, param=e.param, error=str(e))
            return web.json_response(error_body(str(e), e.status, self.engine.policy_version, e.param),
                                     status=e.status, headers=e.headers)


def _json_value(text: str) -> Any:
    """A request body by msgspec (a third of json's time); by json what only json reads (NaN, Infinity), or to raise
    its ``JSONDecodeError``."""
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return json.loads(text)


def _json_text(value: Any) -> str:
    """A response body by msgspec (a tenth of json's time)."""
    return msgspec.json.encode(value).decode()


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def main(config: RlbusConfig, args: argparse.Namespace) -> int:
    """Serve until SIGTERM (``args`` parsed by :func:`workers.inference.server.parse_args`)."""
    if config.inference.num_threads:
        torch.set_num_threads(config.inference.num_threads)
    asyncio.run(run_worker(InferenceServer(config, args.host, args.port, args.server_id)))
    return 0
