"""FSDP over two gloo ranks matches one rank."""

import torch

from tests.trainer.helpers import fsdp_rank_step, run_step, setup_policy, step_batches
from trainer.config import TrainerConfig
from trainer.optim import build_optimizer, build_scheduler

torch.set_num_threads(1)


def test_fsdp_two_gloo_ranks_match_one_rank(tmp_path):
    from trainer.dist import spawn

    out = tmp_path / "fsdp.pt"
    spawn(2, fsdp_rank_step, (str(out), 4))
    two = torch.load(out, weights_only=False)
    policy, opt, sched = setup_policy(lr=1e-2, seed=0)
    opt = build_optimizer(policy, TrainerConfig(lr=1e-2))
    sched = build_scheduler(opt, TrainerConfig(lr=1e-2), None)
    one = run_step(policy, opt, sched, step_batches(1, 4))
    assert abs(one["loss"] - two["metrics"]["loss"]) < 1e-5
    for name, tensor in policy.lm.state_dict().items():
        assert torch.allclose(tensor, two["state"][name], atol=1e-5), name
