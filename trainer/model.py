"""Load a Hugging Face causal LM from a local folder onto the training device.

fp32 on CPU, bf16 on GPU (``model.dtype = "auto"``); attention through PyTorch SDPA so packed
samples (position ids restarting at 0) get transformers' block-diagonal causal mask.
"""

from pathlib import Path

import torch
from torch import nn

from bus.errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` → the local GPU when CUDA is available, else CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("trainer.device='cuda' but no CUDA device is visible; set trainer.device = 'cpu'")
        return torch.device("cuda", local_rank)
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` → float32 on CPU, bfloat16 on GPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def load_model(path: str | Path, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``AutoModelForCausalLM`` from ``path`` in ``dtype`` on ``device``, in train mode, KV cache off."""
    from transformers import AutoModelForCausalLM

    if not Path(path).exists() and Path(path).is_absolute():
        raise ConfigError(f"model.path={str(path)!r} does not exist; "
                          f"run `rlbus init-model --out {path}` or fix the path")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model.to(device).train()


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
