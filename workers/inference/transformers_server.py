"""The built-in inference server (``inference.backend = "transformers"``): aiohttp over the dynamic-batching engine.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both also with ``"stream": true``: server-sent
events as the tokens are sampled), ``POST /inference/v1/generate`` (token ids in and out, :mod:`generate_api`),
``GET /v1/models``, ``GET /health``.
Every JSON response carries ``policy_version``. With ``redis.url`` set the server follows ``weights``
and publishes ``served``; without it, it serves the model at ``model.path`` as version 0.
"""

import argparse
import asyncio
import json
from typing import Any

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
from workers.inference.engine import Engine
from workers.inference.generate_api import generate_request, generate_response
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
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def setup(self) -> None:
        self.engine = await asyncio.to_thread(self._build_engine)
        self.engine.start()
        self.renderer = Renderer(self.engine.tokenizer, self.config.model.path)
        if self.config.redis.url:
            await self._setup_follower()
        else:
            self.log.warning("weights_follow_disabled", reason="redis.url is not set; serving model.path as version 0")
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/inference/v1/generate", self.generate),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
        ])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.log.info("server_ready", host=self.host, port=self.port, model=self.config.model.path,
                      policy_version=self.engine.policy_version)

    def _build_engine(self):
        hf_logging.disable_progress_bar()
        cfg = self.config.inference
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = resolve_dtype(self.config.model.dtype, torch.device(device))
        tokenizer = AutoTokenizer.from_pretrained(self.config.model.path)
        model = AutoModelForCausalLM.from_pretrained(self.config.model.path, dtype=dtype).to(device).eval()
        eos = {tokenizer.eos_token_id} | set(_as_list(model.generation_config.eos_token_id))
        return Engine(model, tokenizer, max_batch_size=cfg.max_batch_size, max_model_len=cfg.max_model_len,
                      eos_token_ids={t for t in eos if t is not None})

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
        await run_until_first(self._stop, self._watch_engine(), *([self.follower.run()] if self.follower else []))

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
            gens = await asyncio.gather(*(self._generate(p, params) for p in prompts))
            return self.renderer.completion(list(gens), body)

        return await self._respond(request, handle)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        async def handle(body: dict) -> dict | web.StreamResponse:
            params = sampling_params(body, chat=True)
            prompt = chat_prompt(body, self.engine.tokenizer)
            if body.get("stream"):
                return await self._stream(request, body, [prompt], params, chat=True)
            gen = await self._generate(prompt, params)
            return self.renderer.chat(gen, body)

        return await self._respond(request, handle)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        async def handle(body: dict) -> dict:
            prompt_ids, params = generate_request(body)
            return generate_response(await self._generate(prompt_ids, params), self.config.model.path)

        return await self._respond(request, handle)

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.config.model.path, "object": "model", "owned_by": "rlbus",
                "max_model_len": self.config.inference.max_model_len}
        return web.json_response({"object": "list", "data": [card], "policy_version": self.engine.policy_version})

    async def health(self, request: web.Request) -> web.Response:
        ok = self.engine.alive
        return web.json_response({"status": "ok" if ok else "engine_dead", "policy_version": self.engine.policy_version,
                                  "active": self.engine.active, "steps": self.engine.steps,
                                  "prefills": self.engine.prefills,
                                  "generated_tokens": self.engine.generated_tokens}, status=200 if ok else 503)

    async def _stream(self, request: web.Request, body: dict, prompts: list[list[int]], params,
                      chat: bool) -> web.StreamResponse:
        """Server-sent events of every choice's text as the engine samples it (see :mod:`streaming`)."""
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue = asyncio.Queue()
        handles = []
        try:
            for p, prompt_ids in enumerate(prompts):
                handles.append(self.engine.submit(prompt_ids, params, on_token=lambda j, t, p=p: (
                    loop.call_soon_threadsafe(tokens.put_nowait, (p * params.n + j, t)))))
        except ValueError as e:
            for handle in handles:
                handle.cancelled = True
            raise ApiError(str(e)) from e
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
            for handle in handles:
                handle.cancelled = True  # the client went away: free its batch rows
            done.cancel()
            if next_token is not None:
                next_token.cancel()
            raise
        return response

    async def _generate(self, prompt_ids: list[int], params):
        try:
            handle = self.engine.submit(prompt_ids, params)
        except ValueError as e:
            raise ApiError(str(e)) from e
        try:
            return await asyncio.wrap_future(handle.future)
        except asyncio.CancelledError:
            handle.cancelled = True  # the client went away: free its batch rows
            raise

    async def _respond(self, request: web.Request, handle) -> web.Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ApiError("the request body must be a JSON object")
            out = await handle(body)
            return out if isinstance(out, web.StreamResponse) else web.json_response(out)
        except json.JSONDecodeError as e:
            return web.json_response(error_body(f"invalid JSON body: {e}", 400, self.engine.policy_version), status=400)
        except ApiError as e:
            return web.json_response(error_body(str(e), e.status, self.engine.policy_version), status=e.status)


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
