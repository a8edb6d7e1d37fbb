"""The vLLM command line, environment and reload calls (no vLLM needed)."""


import aiohttp
import msgspec
import pytest
from aiohttp import web

from bus.messages import WeightUpdate
from workers.config import RlbusConfig
from workers.inference.vllm_launcher import VllmServer, vllm_command, vllm_env


def test_vllm_command_and_env(tmp_path):
    config = RlbusConfig.model_validate({"model": {"path": "/m"}, "run": {"output_dir": str(tmp_path)},
                                         "inference": {"vllm_args": ["--seed", "1"], "num_threads": 2}})
    cmd = vllm_command(config, "127.0.0.1", 8001)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--enforce-eager" in cmd
    assert cmd[cmd.index("--model") + 1] == "/m" and cmd[-2:] == ["--seed", "1"]
    env = vllm_env(config)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"


def test_without_the_weight_transfer_api_auto_falls_back_to_the_extension_and_native_is_refused(tmp_path,
                                                                                                monkeypatch):
    """A vLLM without ``vllm.distributed.weight_transfer`` (or no vLLM in this Python) still serves: auto loads
    through the worker extension; asking for native is a ConfigError that names the way out."""
    from bus.errors import ConfigError
    from workers.inference import vllm_launcher

    monkeypatch.setattr(vllm_launcher, "has_transfer_api", lambda: False)
    config = RlbusConfig.model_validate({"model": {"path": "/m"}, "run": {"output_dir": str(tmp_path)}})
    cmd = vllm_command(config, "127.0.0.1", 8001)
    assert "--worker-extension-cls" in cmd and "--weight-transfer-config" not in cmd
    native = config.model_copy(update={"inference": config.inference.model_copy(
        update={"vllm_weight_transfer": "native"})})
    with pytest.raises(ConfigError, match="weight-transfer API.*set it to 'auto'"):
        vllm_command(native, "127.0.0.1", 8001)


def test_vllm_gets_the_api_key_from_the_environment_not_the_command_line(tmp_path, monkeypatch):
    """inference.api_key_var names the variable; vLLM gets the key as VLLM_API_KEY (its --api-key), never in argv
    (``ps`` shows argv to every user of the machine)."""
    monkeypatch.setenv("RLBUS_INFERENCE_API_KEY", "k-123")
    config = RlbusConfig.model_validate({"model": {"path": "/m"}, "run": {"output_dir": str(tmp_path)},
                                         "inference": {"api_key_var": "RLBUS_INFERENCE_API_KEY"}})
    assert vllm_env(config)["VLLM_API_KEY"] == "k-123"
    assert not any("k-123" in a for a in vllm_command(config, "127.0.0.1", 8001))
    monkeypatch.delenv("RLBUS_INFERENCE_API_KEY")
    with pytest.raises(ValueError, match="RLBUS_INFERENCE_API_KEY"):
        vllm_env(config)


def test_the_server_runs_its_own_thread_share_not_the_one_it_inherits(tmp_path, monkeypatch):
    """`rlbus run` exports the trainer's share (OMP_NUM_THREADS=2 in a run that trains on reference answers) to every
    child; vLLM's CPU worker ran that many threads on the one core it pins itself to, and each LoRA prefill took
    ~200x longer (8 eval requests: 55 s against 0.27 s). The server gets its own share and leaves the cores unpinned
    (rlbus shares them between its processes) unless the user chose a binding."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("MKL_NUM_THREADS", "2")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    config = RlbusConfig.model_validate({"model": {"path": "/m"}, "run": {"output_dir": str(tmp_path)},
                                         "inference": {"num_threads": 1}})
    env = vllm_env(config)
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("1", "1", "nobind")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert vllm_env(config)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    unset = RlbusConfig.model_validate({"model": {"path": "/m"}, "run": {"output_dir": str(tmp_path)}})
    assert vllm_env(unset)["OMP_NUM_THREADS"] == "2"  # a server started on its own: the user's environment stands


async def test_reload_pauses_reloads_resets_and_resumes_and_a_failed_reset_is_an_error(tmp_path):
    """The reload against a stand-in for vLLM's dev endpoints: pause (keeping requests), reload, prefix-cache reset,
    resume; a reset that vLLM reports as failed (blocks still held) is an error, not a silent stale cache, and
    the engine is resumed all the same."""
    calls = []
    answer = {"success": True}

    async def rpc(request):
        calls.append((request.path_qs, await request.json()))
        return web.json_response({"results": [None]})

    async def reset(request):
        calls.append((request.path_qs, None))
        return web.json_response(answer)

    async def plain(request):
        calls.append((request.path_qs, None))
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/collective_rpc", rpc)
    app.router.add_post("/reset_prefix_cache", reset)
    app.router.add_post("/pause", plain)
    app.router.add_post("/resume", plain)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    config = RlbusConfig.model_validate({"model": {"path": "/m"}, "run": {"output_dir": str(tmp_path)}})
    server = VllmServer(config, "127.0.0.1", port, "vllm-0")
    server.session = aiohttp.ClientSession()
    event = WeightUpdate(step=3, format="safetensors", dir=str(tmp_path), files=[])
    try:
        await server.reload(event)
        answer["success"] = False
        with pytest.raises(RuntimeError, match="could not reset its prefix cache"):
            await server.reload(event)
    finally:
        await server.session.close()
        await runner.cleanup()
    rpc_call = ("/collective_rpc", {"method": "rlbus_reload_weights", "kwargs": {"weights_path": str(tmp_path)}})
    once = [("/pause?mode=keep", None), rpc_call, ("/reset_prefix_cache", None), ("/resume", None)]
    assert calls == once + once


async def test_a_broadcast_event_is_joined_through_the_worker_extension_between_pause_and_resume(tmp_path):
    """An nccl/gloo event takes the same pause / rpc / reset / resume path, the rpc being the extension's
    ``rlbus_receive_broadcast`` with the event as JSON and the trainer's broadcast timeout."""
    from bus.messages import WeightTensor

    calls = []

    async def handle(request):
        body = await request.json() if request.path == "/collective_rpc" else None
        calls.append((request.path_qs, body))
        return web.json_response({"results": [{"receive_ms": 5.0, "load_ms": 2.0, "bytes": 8}]}
                                 if body else {"success": True})

    app = web.Application()
    for path in ("/collective_rpc", "/reset_prefix_cache", "/pause", "/resume"):
        app.router.add_post(path, handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    config = RlbusConfig.model_validate({"model": {"path": "/m"}, "run": {"output_dir": str(tmp_path)},
                                         "trainer": {"weight_transport": "nccl", "broadcast_timeout_s": 42}})
    server = VllmServer(config, "127.0.0.1", port, "vllm-0")  # nccl is accepted now
    server.session = aiohttp.ClientSession()
    event = WeightUpdate(step=4, format="nccl", host="127.0.0.1", port=1234, world_size=2,
                         tensors=[WeightTensor(name="w", dtype="float32", shape=[2])])
    try:
        await server.reload(event)
    finally:
        await server.session.close()
        await runner.cleanup()
    assert [c[0] for c in calls] == ["/pause?mode=keep", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    rpc = calls[1][1]
    assert rpc["method"] == "rlbus_receive_broadcast" and rpc["kwargs"]["timeout_s"] == 42
    assert msgspec.convert(rpc["kwargs"]["event"], WeightUpdate) == event
