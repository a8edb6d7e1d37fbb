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
