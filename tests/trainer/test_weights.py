"""Weights on disk: round trip, shards, an untied head."""

import pytest
import torch

from tests.trainer.helpers import tiny_lm

torch.set_num_threads(1)


def test_save_and_load_weights_round_trip(tmp_path):
    from bus.weight_files import verify_weights
    from trainer.weights import (
        load_weights_into,
        prune_weights,
        read_weights,
        save_weights,
        weights_dir,
    )

    src = tiny_lm(seed=1)
    dst = tiny_lm(seed=2)
    files = save_weights(src, weights_dir(tmp_path, 1), max_shard_mb=1)
    small = save_weights(src, weights_dir(tmp_path, 2), max_shard_mb=1)
    assert [f.name for f in files] == [f.name for f in small]
    verify_weights(weights_dir(tmp_path, 1), files)
    assert "lm.lm_head.weight" not in read_weights(weights_dir(tmp_path, 1))
    assert "lm_head.weight" not in read_weights(weights_dir(tmp_path, 1))  # tied: stored once
    load_weights_into(dst, weights_dir(tmp_path, 1))
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        assert torch.equal(src(input_ids=ids).logits, dst(input_ids=ids).logits)
    assert dst.lm_head.weight is dst.model.embed_tokens.weight
    for step in (3, 4, 5):
        save_weights(src, weights_dir(tmp_path, step), 1)
    assert prune_weights(tmp_path, keep=2, protected={1}) == [2, 3]


def test_save_weights_shards_and_untied_head(tmp_path):
    from transformers import AutoModelForCausalLM

    from bus.weight_files import verify_weights
    from trainer.weights import load_weights_into, save_weights

    src = tiny_lm(seed=1, tie=False)
    state = src.state_dict()
    assert "lm_head.weight" in state
    files = save_weights(state, tmp_path / "w2", max_shard_mb=0.1, config=src.config)
    assert len(files) > 2 and files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    assert all(f.bytes <= 0.1 * 2**20 + 2**16 for f in files)
    verify_weights(tmp_path / "w2", files)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "w2")  # a plain HF folder
    dst = tiny_lm(seed=3, tie=False)
    load_weights_into(dst, tmp_path / "w2")
    for (n, a), b in zip(src.state_dict().items(), reloaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), n


def test_saves_killed_midway_are_removed_and_finished_ones_kept(tmp_path):
    from trainer.weights import remove_interrupted_saves, save_weights, weights_dir

    done = weights_dir(tmp_path, 1)
    save_weights(tiny_lm(seed=1), done, 1)
    half = tmp_path / "weights" / ".tmp-step_2-0123abcd"
    half.mkdir()
    (half / "model-00001-of-00002.safetensors").write_bytes(b"half")
    assert remove_interrupted_saves(tmp_path / "weights") == [half]
    assert not half.exists() and (done / "model.safetensors.index.json").exists()
    assert remove_interrupted_saves(tmp_path / "no-such-dir") == []


def test_a_damaged_folder_fails_its_manifest_check_before_it_is_published_again(tmp_path):
    """After a restart the trainer re-publishes the newest folder; it used to hash whatever was on disk (damage
    included) into the event. The manifest written with the folder catches the damage, and the trainer rewrites it."""
    from trainer.weights import MANIFEST_NAME, describe_weights, save_weights, verified_weights

    model = tiny_lm()
    files = save_weights(model, tmp_path / "step_1")
    assert verified_weights(tmp_path / "step_1") == files
    shard = tmp_path / "step_1" / files[0].name
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert describe_weights(tmp_path / "step_1") != files  # the old road: the damage's own sha256
    with pytest.raises(ValueError, match="does not match"):
        verified_weights(tmp_path / "step_1")
    (tmp_path / "step_1" / MANIFEST_NAME).unlink()
    with pytest.raises(ValueError, match=MANIFEST_NAME):
        verified_weights(tmp_path / "step_1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_tensors_names_each_tensor_with_a_nan_or_inf_and_only_those(dtype):
    from trainer.weights import nonfinite_tensors

    state = {"a": torch.ones(4, 3, dtype=dtype), "b": torch.zeros(5, dtype=torch.float32),
             "c": torch.arange(3), "empty": torch.ones(0, dtype=dtype)}
    assert nonfinite_tensors(state) == []
    state["a"][1, 2], state["b"][0] = float("nan"), float("-inf")
    assert nonfinite_tensors(state) == ["a", "b"]
    # finite values whose norm overflows are not flagged
    assert nonfinite_tensors({"big": torch.full((4,), 3e38, dtype=torch.float32)}) == []
