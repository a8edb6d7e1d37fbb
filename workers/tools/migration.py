"""Where each prime-rl orchestrator field and each ART ``PipelineTrainer`` argument lives in rlbus.

One table per tool: a field's path (``train.env[].sampling.temperature``; ``[]`` marks an array of tables)
→ a :class:`Target`, the rlbus key (``env[].sampling.temperature``) or None with the reason there is none.
``rlbus config convert --from prime-rl`` reads :data:`PRIME_RL`; ``docs/configuration.md`` prints both tables,
so the converter and the page never disagree.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bus.errors import ConfigError


@dataclass(frozen=True)
class Target:
    """The rlbus side of one field."""

    key: str | None
    """rlbus's dotted key (``[]`` where the field's array index goes); None: rlbus has no such field."""
    note: str = ""
    """How it differs (units, defaults), or why there is no rlbus field."""
    value: Callable[[Any], Any] | None = None
    """Turns the value into rlbus's (None: the same value)."""
    whole: bool = False
    """The value (an array of tables) carries over as it is, its own keys being rlbus's too."""


def _transport(kind: str) -> str:
    if kind not in ("filesystem", "nccl"):
        raise ConfigError(f"weight_broadcast.type={kind!r}: rlbus knows filesystem (safetensors) and nccl")
    return "safetensors" if kind == "filesystem" else "nccl"


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


_SAMPLING = {
    "temperature": "temperature", "max_completion_tokens": "max_completion_tokens", "max_tokens":
    "max_completion_tokens", "extra_body": "extra_body",
}
_EVAL_SAMPLING = {**_SAMPLING, "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "reasoning_effort": "reasoning_effort"}
_TABLES = {"extra_body", "args", "extra_env_kwargs", "headers_from_env"}
"""Fields whose value is a table of the user's own keys: they carry over whole."""


def _sampling(prefix: str, target: str, names: dict[str, str]) -> dict[str, Target]:
    return {f"{prefix}.{k}": Target(f"{target}.{v}", whole=k in _TABLES) for k, v in names.items()}
_ENV = {
    "id": Target("env[].id", "a built-in env name or `package.module:factory`; verifiers environments do not run"),
    "name": Target("env[].name"), "address": Target("env[].address"), "ratio": Target("env[].ratio"),
    "max_retries": Target("env[].max_retries"), "args": Target("env[].args", whole=True),
    "extra_env_kwargs": Target("env[].args", "passed to the env factory with its args", whole=True),
    "timeout.rollout": Target("env[].rollout_timeout_s"),
    "max_output_tokens": Target("env[].max_total_completion_tokens"),
    "taskset.id": Target("env[].id", "rlbus envs are named by id; a v1 taskset id becomes the env id"),
    "pool": Target(None, "rlbus runs one env server per rollout worker: set rollout.workers"),
    "num_workers": Target(None, "removed in prime-rl too; set rollout.workers and rollout.max_concurrent_groups"),
}

PRIME_RL: dict[str, Target] = {
    "max_steps": Target("run.max_steps"),
    "output_dir": Target("run.output_dir"),
    "batch_size": Target("packer.batch_size"),
    "token_batch_size": Target("packer.token_batch_size"),
    "oversampling_factor": Target("feeder.oversampling_factor",
                                  "derives max_inflight_rollouts as batch_size × factor + (largest group − 1)"),
    "max_inflight_rollouts": Target("feeder.max_inflight_rollouts"),
    "group_size": Target("group_size"),
    "rollouts_per_example": Target("group_size"),
    "seq_len": Target("packer.seq_len", "rlbus packs samples into micro-batches of this many tokens"),
    "max_off_policy_steps": Target("packer.max_off_policy_steps", "counted the same way (0 = strictly on-policy)"),
    "tasks_per_minute": Target("rollout.tasks_per_minute"),
    "bench": Target("bench"),
    "training_mode": Target("training_mode"),
    "num_train_workers": Target("trainer.nproc", "data-parallel trainer ranks"),
    "optim.lr": Target("trainer.lr"),
    "model.name": Target("model.path", "a local Hugging Face folder (a hub name where a hub is reachable)"),
    "student.name": Target("model.path", "[student] is [model] in rlbus"),
    "model.client.base_url": Target("inference.base_urls", value=_as_list),
    "model.client.api_key_var": Target("inference.api_key_var"),
    "model.client.headers_from_env": Target("inference.headers_from_env", whole=True),
    "model.client.timeout": Target("inference.request_timeout_s"),
    "model.lora": Target(None, "LoRA is not in rlbus yet"),
    "teacher.model.name": Target("teacher.path"),
    "teacher.client.base_url": Target("teacher.base_urls", value=_as_list),
    "teacher.client.api_key_var": Target(None, "the teacher shares the inference client's settings in rlbus today"),
    "train.max_retries": Target("max_retries"),
    **_sampling("train.sampling", "sampling", _SAMPLING),
    **{f"train.env[].{k}": t for k, t in _ENV.items()},
    **_sampling("train.env[].sampling", "env[].sampling", _SAMPLING),
    "train.env[].group_size": Target("env[].group_size"),
    "train.env[].rollouts_per_example": Target("env[].group_size"),
    "train.env[].algo": Target(None, "rlbus has one algorithm family (GRPO-style advantages); per-env "
                                     "advantage settings are env[].advantage"),
    "eval.interval": Target("eval.interval"),
    "eval.num_examples": Target("eval.num_examples"),
    "eval.group_size": Target("eval.group_size"),
    "eval.rollouts_per_example": Target("eval.group_size"),
    "eval.max_retries": Target("eval.max_retries"),
    "eval.skip_first_step": Target("eval.skip_first_step"),
    **_sampling("eval.sampling", "eval.sampling", _EVAL_SAMPLING),
    **{f"eval.env[].{k}": Target(t.key and t.key.replace("env[]", "eval.env[]"), t.note, whole=t.whole)
       for k, t in _ENV.items()},
    **_sampling("eval.env[].sampling", "eval.env[].sampling", _EVAL_SAMPLING),
    "eval.env[].num_examples": Target("eval.env[].num_examples"),
    "eval.env[].group_size": Target("eval.env[].group_size"),
    "eval.env[].rollouts_per_example": Target("eval.env[].group_size"),
    "eval.env[].interval": Target("eval.env[].interval"),
    "pre_batch_filters": Target("filter.pre_batch_filters", "same filter types and knobs", whole=True),
    "post_batch_filters": Target("packer.post_batch_filters", "same filter types and knobs", whole=True),
    "ckpt.interval": Target("ckpt.interval"),
    "ckpt.resume_step": Target("ckpt.resume_step"),
    "ckpt.wait_for_weights_timeout": Target("ckpt.wait_for_weights_timeout"),
    "ckpt.keep_last": Target("ckpt.keep_last"),
    "ckpt.keep_interval": Target("ckpt.keep_interval"),
    "ckpt.skip_progress": Target("ckpt.skip_progress"),
    "weight_broadcast.type": Target("trainer.weight_transport", "filesystem → safetensors", value=_transport),
    "weight_broadcast.host": Target("trainer.nccl_host"),
    "weight_broadcast.port": Target("trainer.nccl_port"),
    "weight_broadcast.timeout": Target("trainer.broadcast_timeout_s"),
    "weight_broadcast.quantize_in_weight_transfer": Target(None, "weights travel in the training dtype"),
    "weight_broadcast.inference_world_size": Target("trainer.inference_world_size"),
    "log.level": Target("log.level"),
    "wandb.project": Target("wandb.project"),
    "wandb.name": Target("wandb.name"),
    "tokenizer": Target(None, "the tokenizer is the one in model.path"),
    "renderer": Target(None, "rlbus applies the model's own chat template and keeps the token ids it sampled"),
    "pool_size": Target(None, "no renderer pool: tokenization happens once per turn in the rollout worker"),
    "env_vars": Target(None, "set the environment of each worker process (compose, Kubernetes) instead"),
    "prime_monitor": Target(None, "no Prime monitor service; metrics go to metrics.jsonl and W&B"),
    "heartbeat": Target(None, "no BetterStack heartbeat; inference servers heartbeat in Redis"),
    "collect_inference_metrics": Target(None, "not collected"),
    "inference_metrics_roles": Target(None, "not collected"),
    "rollout_transport": Target(None, "Redis streams are the transport"),
    "experimental": Target(None, "no experimental section"),
    "multimodal": Target(None, "text only"),
    "algo": Target(None, "advantages are set in filter.advantage (GRPO-style), the loss in trainer.loss"),
}
"""prime-rl's orchestrator config (``[orchestrator]`` of an ``rl`` TOML, or an orchestrator TOML) → rlbus."""

ART: dict[str, Target] = {
    "model": Target("model.path", "a local Hugging Face folder"),
    "backend": Target("inference.backend", "transformers (built-in) or vllm; training runs in `rlbus trainer`"),
    "rollout_fn": Target("env[].id", "an env: `package.module:factory` returning initial/step/score"),
    "scenarios": Target("env[].args", "the env's dataset, built by its factory from args"),
    "config": Target("env[].args"),
    "eval_fn": Target("eval.env", "eval environments ([[eval.env]])"),
    "num_rollout_workers": Target("rollout.max_concurrent_groups", "groups in flight per rollout worker; "
                                  "rollout.workers adds processes"),
    "min_batch_size": Target("packer.batch_size", "in samples (ART counts groups: min_batch_size × group_size)"),
    "max_batch_size": Target("packer.max_batch_size", "in samples; None takes batch_size every step (ART: 10×)"),
    "max_steps_off_policy": Target("packer.max_off_policy_steps", "counted the same way (0 = strictly on-policy)"),
    "queue_maxsize": Target("feeder.max_inflight_rollouts", "in samples"),
    "learning_rate": Target("trainer.lr"),
    "loss_fn": Target("trainer.loss.type", "cispo, ppo, dppo (default) or custom"),
    "loss_fn_config": Target("trainer.loss", "the chosen loss's knobs"),
    "normalize_advantages": Target("filter.advantage.std_normalize", "off by default in rlbus (Dr. GRPO)"),
    "adam_params": Target("trainer.betas", "with trainer.weight_decay"),
    "kl_penalty_coef": Target("trainer.kl_penalty_coef"),
    "kl_penalty_reference_step": Target("trainer.kl_penalty_reference_step"),
    "max_steps": Target("run.max_steps"),
    "discard_queue_multiplier": Target("packer.collapse_after", "zero-variance groups in a row that stop the run; "
                                       "default 100 × the batch in groups, as ART's"),
    "log_interval_seconds": Target("status.log_interval_seconds"),
    "status_ewa_alpha": Target("status.ewa_alpha"),
    "total_scenarios": Target(None, "the env reports its dataset size"),
    "eval_every_n_steps": Target("eval.interval"),
    "eval_step_0": Target("eval.skip_first_step", "inverted"),
    "save_checkpoint": Target("ckpt.interval", "checkpoints every this many steps (None: never)"),
    "resume": Target("ckpt.resume_step", "-1 resumes from the newest checkpoint (rlbus run's default)"),
}
"""ART's ``PipelineTrainer(...)`` arguments → rlbus."""

DIFFERENCES: list[tuple[str, str]] = [
    ("group_size = 8 by default", "prime-rl's is 1; a GRPO group needs more than one sample to have a signal"),
    ("batch sizes count samples", "ART counts groups; prime-rl's batch_size counts samples, as rlbus's"),
    ("filter.advantage.std_normalize = false", "ART normalises by default; Dr. GRPO showed the std division biases"
     " toward easy and hard prompts"),
    ("[[env]] and [sampling] at the top level", "prime-rl nests them under [train]; rlbus has one training pool"),
    ("model.path instead of model.name", "models are local folders (no hub in CI); a hub name still works where "
     "one is reachable"),
    ("prefetch_steps (1)", "rlbus builds a step ahead of the trainer; it is capped at max_off_policy_steps, so "
     "0 stays strictly on-policy"),
    ("trainer.loss = dppo", "ART defaults to cispo; dppo is prime-rl's default"),
    ("an empty Redis restores from the checkpoint", "prime-rl's orchestrator keeps its progress in its own "
     "checkpoint; rlbus keeps it in Redis and copies it into every trainer checkpoint"),
]
"""Where rlbus differs on purpose: (what, why)."""


def flatten(data: dict, table: dict[str, Target], prefix: str = "") -> list[tuple[str, list[int], Any]]:
    """(path with ``[]`` for array items, the array indices on the way, value) of every leaf of ``data``; a path
    the table copies whole stops the descent."""
    out = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if path in table and table[path].whole:
            out.append((path, [], value))
        elif isinstance(value, dict):
            out += flatten(value, table, path + ".")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, item in enumerate(value):
                out += [(p, [i, *idx], v) for p, idx, v in flatten(item, table, path + "[].")]
        else:
            out.append((path, [], value))
    return out


def lookup(path: str, table: dict[str, Target]) -> Target | None:
    """The target of ``path``; else that of its nearest ancestor when the ancestor has no rlbus field (everything
    under ``tokenizer`` is left behind with ``tokenizer``'s reason); else None."""
    if path in table:
        return table[path]
    while "." in path:
        path = path.rpartition(".")[0]
        if path in table:
            return table[path] if table[path].key is None else None
    return None
