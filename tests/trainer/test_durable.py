"""Checkpoints and weights folders reach the disk before the rename that publishes them."""

import os

import torch

from tests.trainer.helpers import setup_policy
from trainer.config import CkptConfig
from trainer.dist import DistContext

torch.set_num_threads(1)


def _record(monkeypatch) -> list[tuple[str, str]]:
    """Log every fsync and rename of the publication as (call, path name)."""
    calls: list[tuple[str, str]] = []
    fsync, rename = os.fsync, os.rename
    names: dict[int, str] = {}
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        names[fd] = os.path.basename(os.fspath(path))
        return fd

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(("fsync", names.get(fd, "?"))), fsync(fd))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (calls.append(("rename", os.path.basename(b))), rename(a, b))[1])
    return calls


def _check_order(calls: list[tuple[str, str]], final: str, parent: str, files: set[str]) -> None:
    at = calls.index(("rename", final))
    before = {name for call, name in calls[:at] if call == "fsync"}
    assert files <= before, f"not fsynced before the rename: {files - before}"
    assert any(name.startswith(".tmp-") for name in before), "the temp directory itself was not fsynced"
    assert ("fsync", parent) in calls[at:], "the parent directory was not fsynced after the rename"


def test_a_checkpoint_is_fsynced_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    from trainer.checkpoint import DIGEST_NAME, FILE_NAME, Checkpointer

    ckpt = Checkpointer(tmp_path, CkptConfig(interval=1), DistContext())
    policy, opt, sched = setup_policy()
    calls = _record(monkeypatch)
    ckpt.save(1, policy, opt, sched)
    _check_order(calls, "step_1", "checkpoints", {FILE_NAME, DIGEST_NAME})


def test_a_weights_folder_is_fsynced_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    from trainer.weights import INDEX_NAME, MANIFEST_NAME, save_weights

    policy, _, _ = setup_policy()
    calls = _record(monkeypatch)
    save_weights(policy, tmp_path / "weights" / "step_1", max_shard_mb=0.01)
    shards = {n for n in os.listdir(tmp_path / "weights" / "step_1") if n.endswith(".safetensors")}
    assert len(shards) > 1
    _check_order(calls, "step_1", "weights", shards | {INDEX_NAME, MANIFEST_NAME})
