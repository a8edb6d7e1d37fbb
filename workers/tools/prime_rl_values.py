"""The value conversions of the prime-rl table (:mod:`workers.tools.migration_prime_rl`): a prime-rl value →
rlbus's, or :class:`~workers.tools.migration.Lost` with the reason rlbus has no equivalent of it."""

import json
from typing import Any

from workers.tools.migration import Lost, Target


def transport(kind: str) -> str:
    if kind not in ("filesystem", "nccl"):
        raise Lost(f"weight_broadcast.type={kind!r}: rlbus publishes weights as safetensors files or over NCCL")
    return "safetensors" if kind == "filesystem" else "nccl"


def as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def wandb_mode(offline: bool) -> str:
    return "offline" if offline else "online"


def truncated(mask: bool) -> list | None:
    """``mask_truncated_completions = true`` adds rlbus's truncated filter to its default post-batch filters."""
    if not mask:
        return None
    return [{"type": "gibberish"}, {"type": "repetition"}, {"type": "zero_advantage"}, {"type": "truncated"}]


def flag(name: str) -> Target:
    """A vLLM engine setting → its command-line flag in ``inference.vllm_args``."""
    return Target("inference.vllm_args", f"{name}; vllm_args apply with inference.backend = \"vllm\"",
                  value=lambda v: [name] if v is True else [name, str(v)] if v is not False else None, append=True)


def vllm_flags(table: dict) -> list[str]:
    """prime-rl's ``[inference.vllm]`` (vLLM engine arguments, passed through) → vLLM's command-line flags."""
    flags = []
    for key, value in table.items():
        flag = "--" + key.replace("_", "-")
        if value is False or value is None:
            raise Lost(f"inference.vllm.{key}={value!r}: give vLLM's own flag for it in inference.vllm_args")
        if value is True:
            flags.append(flag)
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def placement(deployment: dict) -> None:
    single = {"type": "single_node", "num_train_gpus": 1, "num_infer_gpus": 1}
    if any(single.get(k, object()) != v for k, v in deployment.items() if k != "gpus_per_node"):
        raise Lost("placement is the launcher's: rlbus run on one machine (one trainer and one inference GPU), "
                   "compose or Kubernetes across many")


def adamw(kind: str) -> None:
    if kind != "adamw":
        raise Lost(f"optim.type={kind!r}: rlbus's optimiser is AdamW")


def renderer(name: str) -> None:
    if name != "default":
        raise Lost(f"renderer.name={name!r}: rlbus renders with the model's own chat template (prime-rl's "
                   "\"default\" renderer), not a model-specific one")


def mode(algo: str) -> str:
    if algo not in ("grpo", "opd", "sft"):
        raise Lost(f"algo.type={algo!r}: rlbus's modes are rl (GRPO-style), opd and sft")
    return {"grpo": "rl"}.get(algo, algo)
