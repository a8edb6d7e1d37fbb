"""AdamW and the learning-rate schedule: linear warmup, then constant or cosine down to ``min_lr_ratio``."""

import math

import torch
from torch import nn

from bus.errors import ConfigError
from trainer.config import TrainerConfig

FUSED_DEVICES = ("cpu", "cuda")
"""Devices whose parameters get PyTorch's fused AdamW kernel."""


def build_optimizer(model: nn.Module, cfg: TrainerConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters with ``[trainer]`` lr, betas and weight decay; PyTorch's fused kernel
    where every parameter is on a CPU or CUDA device (one kernel for all tensors: a tiny model's step took 0.67 ms
    against 2.07 ms on CPU), its per-tensor loop elsewhere."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = all(p.device.type in FUSED_DEVICES for p in params)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused or None)


def lr_factor(step: int, cfg: TrainerConfig, max_steps: int | None) -> float:
    """Multiplier of ``cfg.lr`` for optimizer step ``step`` (0-based count of steps already taken)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    assert max_steps is not None
    decay_steps = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainerConfig, max_steps: int | None
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR applying :func:`lr_factor`; cosine needs ``run.max_steps``."""
    if cfg.schedule == "cosine" and max_steps is None:
        raise ConfigError("trainer.schedule='cosine' needs run.max_steps to know where the decay ends; "
                          "set run.max_steps")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, max_steps))
