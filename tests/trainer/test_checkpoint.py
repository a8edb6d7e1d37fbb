"""Checkpoints restore model, optimizer and schedule."""

import pytest
import torch

from tests.trainer.helpers import run_step, setup_policy, step_batches
from trainer.config import CkptConfig
from trainer.dist import DistContext

torch.set_num_threads(1)


def test_checkpoint_round_trip_restores_optimizer_and_schedule(tmp_path):
    from trainer.checkpoint import Checkpointer

    ckpt = Checkpointer(tmp_path, CkptConfig(interval=1, keep_last=2, keep_interval=2), DistContext())
    policy, opt, sched = setup_policy(warmup_steps=3)
    for step in (1, 2, 3):
        run_step(policy, opt, sched, step_batches(step, 2), step=step)
        ckpt.save(step, policy, opt, sched)
    assert ckpt.steps() == [2, 3]  # keep_last 2; step 2 also a keep_interval multiple
    assert ckpt.resolve(-1) == 3 and ckpt.resolve(None) is None
    restored, opt2, sched2 = setup_policy(seed=5, warmup_steps=3)
    ckpt.load(3, restored, opt2, sched2)
    a = run_step(policy, opt, sched, step_batches(4, 2), step=4)
    b = run_step(restored, opt2, sched2, step_batches(4, 2), step=4)
    assert a["lr"] == b["lr"]
    for x, y in zip(policy.parameters(), restored.parameters(), strict=True):
        assert torch.equal(x, y)
    from bus.errors import ConfigError

    with pytest.raises(ConfigError, match="resume_step=7"):
        ckpt.resolve(7)


def _damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:  # a few flipped bytes in the middle: torch.load may well read it without a complaint
        for i in range(len(data) // 2, len(data) // 2 + 16):
            data[i] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "flipped"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, how):
    """It used to be taken as the latest anyway: the trainer then exited on every restart (truncated) or resumed
    from damaged tensors (flipped). Now it is skipped with a ``checkpoint_corrupt`` event naming it."""
    from structlog.testing import capture_logs

    from trainer.checkpoint import FILE_NAME, Checkpointer

    ckpt = Checkpointer(tmp_path, CkptConfig(interval=1, keep_last=3), DistContext())
    policy, opt, sched = setup_policy(warmup_steps=3)
    for step in (1, 2, 3):
        run_step(policy, opt, sched, step_batches(step, 2), step=step)
        ckpt.save(step, policy, opt, sched)
        if step == 2:
            at_two = [p.detach().clone() for p in policy.parameters()]
    _damage(ckpt.root / "step_3" / FILE_NAME, how)
    with capture_logs() as logs:
        assert ckpt.resolve(-1) == 2
    (event,) = [e for e in logs if e["event"] == "checkpoint_corrupt"]
    assert event["step"] == 3 and "step_3" in event["path"]
    restored, opt2, sched2 = setup_policy(seed=5, warmup_steps=3)
    ckpt.load(2, restored, opt2, sched2)
    for x, y in zip(at_two, restored.parameters(), strict=True):
        assert torch.equal(x, y)


def test_only_corrupt_checkpoints_is_an_error_that_says_what_to_do(tmp_path):
    from bus.errors import RlbusError
    from trainer.checkpoint import FILE_NAME, Checkpointer

    ckpt = Checkpointer(tmp_path, CkptConfig(interval=1), DistContext())
    policy, opt, sched = setup_policy()
    ckpt.save(1, policy, opt, sched)
    _damage(ckpt.root / "step_1" / FILE_NAME, "truncated")
    with pytest.raises(RlbusError, match="every checkpoint .* is corrupt"):
        ckpt.resolve(-1)
