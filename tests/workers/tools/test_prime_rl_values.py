"""The prime-rl table's value conversions: rlbus's value, or Lost with the reason."""

import pytest

from workers.tools.migration import Lost
from workers.tools.prime_rl_values import mode, placement, transport, vllm_flags


def test_vllm_engine_arguments_become_their_flags():
    assert vllm_flags({"max_num_seqs": 256, "enforce_eager": True, "compilation_config": {"level": 3}}) == [
        "--max-num-seqs", "256", "--enforce-eager", "--compilation-config", '{"level": 3}']
    with pytest.raises(Lost, match="inference.vllm.enable_prefix_caching=False"):
        vllm_flags({"enable_prefix_caching": False})


def test_one_trainer_and_one_inference_gpu_is_rlbus_runs_placement():
    assert placement({"num_train_gpus": 1, "num_infer_gpus": 1, "gpus_per_node": 8}) is None
    with pytest.raises(Lost, match="placement is the launcher's"):
        placement({"num_train_gpus": 2, "num_infer_gpus": 6})


def test_modes_and_transports():
    assert (mode("grpo"), mode("opd"), transport("filesystem"), transport("nccl")) == ("rl", "opd", "safetensors",
                                                                                     "nccl")
    with pytest.raises(Lost, match="rlbus's modes are rl"):
        mode("max_rl")
