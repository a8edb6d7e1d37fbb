"""LoRA adapters (``[model.lora]``, with peft): injected into the model in place, so the trainer's forward, loss
and distributed code see the same module tree; only the adapter's tensors train, travel and get checkpointed.

On disk an adapter is a PEFT folder: ``adapter_config.json`` + ``adapter_model.safetensors``, tensors named
``base_model.model.{module}.lora_A.weight`` (what ``PeftModel.from_pretrained`` and vLLM's
``/v1/load_lora_adapter`` read). In memory (after :func:`inject`) the same tensor is the module parameter
``{module}.lora_A.default.weight``.
"""

import json
import uuid
from collections.abc import Mapping
from pathlib import Path

from torch import Tensor, nn

from bus.errors import ConfigError
from bus.messages import WeightFile
from bus.weight_files import sha256_of
from trainer.durable import publish_dir
from trainer.weights import write_manifest

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
ADAPTER = "default"
"""peft's name of the one adapter a model carries here."""


def _peft():
    try:
        import peft
    except ImportError as e:
        raise ConfigError("model.lora needs peft: pip install 'rlbus[lora]' (or pip install peft)") from e
    return peft


def peft_config(rank: int, alpha: float, dropout: float, target_modules: list[str], base: str):
    """The ``peft.LoraConfig`` of ``[model.lora]`` over the base model at ``base``."""
    return _peft().LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                              base_model_name_or_path=str(base), task_type="CAUSAL_LM")


def inject(model: nn.Module, config) -> nn.Module:
    """Add the adapter's (zero-initialised ``B``, so the output is unchanged) modules to ``model`` in place and
    freeze everything else. Returns ``model``."""
    _peft().inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad = is_adapter_key(name)
    return model


def is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def has_adapter(model: nn.Module) -> bool:
    return any(is_adapter_key(name) for name, _ in model.named_parameters())


def to_peft_key(name: str) -> str:
    """``[lm.]{module}.lora_A.default.weight`` → ``base_model.model.{module}.lora_A.weight``."""
    name = name.removeprefix("lm.").replace(f".{ADAPTER}.", ".")
    return PEFT_PREFIX + name


def from_peft_key(name: str) -> str:
    """``base_model.model.{module}.lora_A.weight`` → ``{module}.lora_A.default.weight``."""
    name = name.removeprefix(PEFT_PREFIX)
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.", f".{part}.{ADAPTER}.")
    return name


def adapter_tensors(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The adapter's tensors of a model state dict, named as in a PEFT file."""
    return {to_peft_key(name): tensor for name, tensor in state.items() if is_adapter_key(name)}


def save_adapter(tensors: Mapping[str, Tensor], dir: Path | str, config) -> list[WeightFile]:
    """Write a PEFT adapter folder atomically (temp dir, then rename); its files with sizes and sha256."""
    from safetensors.torch import save_file

    dir = Path(dir)
    tmp = dir.parent / f".tmp-{dir.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    save_file({n: t.detach().contiguous().cpu() for n, t in tensors.items()}, str(tmp / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    config.save_pretrained(str(tmp))
    files = [WeightFile(name=name, bytes=(tmp / name).stat().st_size, sha256=sha256_of(tmp / name))
             for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)]
    write_manifest(tmp, files)
    publish_dir(tmp, dir)  # fsynced, then renamed into place
    return files


def read_adapter(dir: Path | str, device: str = "cpu") -> tuple[object, dict[str, Tensor]]:
    """(peft LoraConfig, tensors named as in the file) of an adapter folder."""
    from safetensors.torch import load_file

    dir = Path(dir)
    fields = json.loads((dir / ADAPTER_CONFIG).read_text())
    config = _peft().LoraConfig(**{k: v for k, v in fields.items() if k in _LORA_FIELDS})
    return config, load_file(dir / ADAPTER_WEIGHTS, device=device)


_LORA_FIELDS = {"r", "lora_alpha", "lora_dropout", "target_modules", "base_model_name_or_path", "task_type",
                "bias", "fan_in_fan_out", "use_rslora", "init_lora_weights"}
"""adapter_config.json fields that shape the adapter (the rest is peft bookkeeping)."""


def load_adapter_into(model: nn.Module, config, tensors: Mapping[str, Tensor]) -> None:
    """Serve an adapter (:func:`read_adapter`): inject its modules on first use, then copy its tensors in place."""
    import torch

    if not has_adapter(model):
        inject(model, config)
        model.requires_grad_(False)
        model.eval()  # the injected modules (dropout) start in training mode
    params = dict(model.named_parameters())
    names = {from_peft_key(n): t for n, t in tensors.items()}
    missing = {n for n in params if is_adapter_key(n)} - set(names)
    unknown = set(names) - set(params)
    if missing or unknown:
        raise ValueError(f"adapter does not fit the served model: missing {sorted(missing)[:3]}, "
                         f"unknown {sorted(unknown)[:3]} (another rank or target_modules?)")
    with torch.no_grad():
        for name, tensor in names.items():
            params[name].copy_(tensor)


def merged_model(base: Path | str, dir: Path | str, dtype=None) -> nn.Module:
    """The base model at ``base`` with the adapter in ``dir`` merged into its weights (a plain HF model)."""
    from transformers import AutoModelForCausalLM

    peft = _peft()
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=dtype)
    return peft.PeftModel.from_pretrained(model, str(dir)).merge_and_unload()
