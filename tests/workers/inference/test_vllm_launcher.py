"""The vLLM command line and environment (no vLLM needed)."""

from workers.config import RlbusConfig
from workers.inference.vllm_launcher import vllm_command, vllm_env


def test_vllm_command_and_env(tmp_path):
    config = RlbusConfig.model_validate({"model": {"path": "/m"}, "run": {"output_dir": str(tmp_path)},
                                         "inference": {"vllm_args": ["--seed", "1"], "num_threads": 2}})
    cmd = vllm_command(config, "127.0.0.1", 8001)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--enforce-eager" in cmd
    assert cmd[cmd.index("--model") + 1] == "/m" and cmd[-2:] == ["--seed", "1"]
    env = vllm_env(config)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
