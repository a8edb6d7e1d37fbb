"""The learning-rate schedule."""

import torch

from trainer.config import TrainerConfig
from trainer.optim import lr_factor

torch.set_num_threads(1)


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainerConfig(lr=1.0, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    assert [round(lr_factor(s, cfg, 6), 4) for s in range(7)] == [0.5, 1.0, 1.0, 0.8682, 0.55, 0.2318, 0.1]
