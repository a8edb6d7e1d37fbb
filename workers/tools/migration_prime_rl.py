"""Where each field of a prime-rl ``rl`` config lives in rlbus: every layout and name prime-rl has used since 2025-07.

Paths are those of a combined ``rl.toml`` (the shared top level, ``[orchestrator]``, ``[trainer]``,
``[inference]``); a split orchestrator, trainer or inference file is read under its section
(:mod:`workers.tools.prime_rl_layout`). Older names sit beside the current ones (``rollouts_per_prompt``,
``async_level``, ``[environment]``, ``monitor.wandb``, ``eval.benchmarks``). An env block of the verifiers form
(``taskset``, ``agent`` …) carries over 1:1 under :data:`VERIFIERS_ENV`; one named by ``id`` under :data:`ENV`.
"""

from typing import Any

from workers.tools.migration import Target, lost, same
from workers.tools.prime_rl_values import (
    adamw,
    as_list,
    flag,
    mode,
    placement,
    renderer,
    transport,
    truncated,
    vllm_flags,
    wandb_mode,
)

ORCH = "orchestrator."


FINAL_CHECKPOINT = ("an empty [ckpt] checkpoints at the end; rlbus checkpoints every ckpt.interval steps only, so "
                    "it is written as ckpt.interval = max_steps")
"""What an empty ``[ckpt]`` becomes (:func:`workers.tools.prime_rl_convert.convert` writes it)."""


def _sampling(prefix: str, target: str, evals: bool = False) -> dict[str, Target]:
    names = {"temperature": "temperature", "max_completion_tokens": "max_completion_tokens",
             "max_tokens": "max_completion_tokens", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p"}
    if evals:
        names["reasoning_effort"] = "reasoning_effort"
    out = {f"{prefix}.{k}": Target(f"{target}.{v}") for k, v in names.items()}
    out[f"{prefix}.extra_body"] = Target(f"{target}.extra_body", whole=True)
    out[f"{prefix}.n"] = Target("group_size", "prime-rl's 2025 name of rollouts per example")
    out[f"{prefix}.max_seq_len"] = lost("the context limit is packer.seq_len (and inference.max_model_len)")
    return out


ENV: dict[str, Target] = {
    "id": Target("env[].id", "an rlbus env name or `package.module:factory`; a prime-rl (verifiers v0) env id "
                 "does not run until it is replaced"),
    "name": Target("env[].name"), "address": Target("env[].address"), "ratio": Target("env[].ratio"),
    "max_retries": Target("env[].max_retries"), "args": Target("env[].args", whole=True),
    "extra_env_kwargs": Target("env[].args", "passed to the env factory with its args", whole=True),
    "timeout": Target("env[].rollout_timeout_s", "a number: the rollout timeout in seconds"),
    "timeout.rollout": Target("env[].rollout_timeout_s"),
    "timeout.scoring": lost("no separate scoring timeout (env[].rollout_timeout_s bounds a rollout)"),
    "max_output_tokens": Target("env[].max_total_completion_tokens"),
    "group_size": Target("env[].group_size"), "rollouts_per_example": Target("env[].group_size"),
    "num_workers": lost("rlbus runs one env server per rollout worker: set rollout.workers"),
    "pool": lost("rlbus runs one env server per rollout worker: set rollout.workers"),
    "algo": lost("per-env algorithms are not in rlbus: an env's mode (rl, opd, sft) and advantage settings are "
                 "env[].mode and env[].advantage"),
    "curriculum": lost("no curriculum samplers or admission gates (zero-advantage samples are dropped by the "
                       "post-batch zero_advantage filter)"),
    "algo.type": Target("env[].mode", "grpo → rl; opd; sft", value=mode),
    "algo.teacher.name": Target("teacher.path", "rlbus has one [teacher] for every opd and sft env"),
    "algo.teacher.base_url": Target("teacher.base_urls", value=as_list),
}
"""An env block named by ``id`` (prime-rl's ``[[orchestrator.train.env]]`` up to 2026)."""

VERIFIERS_ENV: dict[str, Target] = {
    **{k: t for k, t in ENV.items() if k not in ("id", "timeout.rollout", "timeout.scoring", "pool")},
    "taskset": Target("env[].taskset", "the verifiers env form: 1:1", whole=True),
    "agent": Target("env[].agent", "the verifiers env form: 1:1", whole=True),
    "harness": Target("env[].harness", "as written (prime-rl later nested it under agent)", whole=True),
    "timeout": Target("env[].timeout", "the verifiers env form: 1:1", whole=True),
    "pool": Target("env[].pool", "the verifiers env form: 1:1", whole=True),
    "id": Target("env[].id"),
    "env": Target("env[]", "the source's verifiers env (taskset, agent, players) is the [[env]] itself", spread=True),
    "serve": Target("env[]", "how the env server is hosted (address, pool) sits in the [[env]]", spread=True),
}
"""An env block of the verifiers form (``taskset``/``agent``, or a source's ``env = {…}``): the same names."""

ENV_ARRAYS = {ORCH + "env[]": "env[]", ORCH + "train.env[]": "env[]", ORCH + "train.source[]": "env[]",
              ORCH + "eval.env[]": "eval.env[]", ORCH + "eval.source[]": "eval.env[]"}
"""prime-rl's env arrays (the deprecated shorthand, the 2026 env lists, the current sources) → rlbus's."""


def _env_rows(prefix: str, target: str, rows: dict[str, Target], evals: bool) -> dict[str, Target]:
    out = {f"{prefix}.{k}": Target(t.key and t.key.replace("env[]", target), t.note, t.value, t.whole, t.spread)
           for k, t in rows.items()}
    out |= _sampling(f"{prefix}.sampling", f"{target}.sampling", evals)
    if evals:
        out |= {f"{prefix}.{k}": Target(f"{target}.{k}") for k in ("num_examples", "interval")}
    return out


def env_table(rows: dict[str, Target]) -> dict[str, Target]:
    """The rows of every env array for one env form."""
    out: dict[str, Target] = {}
    for prefix, target in ENV_ARRAYS.items():
        out |= _env_rows(prefix, target, rows, target.startswith("eval"))
    return out


_ORCHESTRATOR = {
    "max_steps": Target("run.max_steps"), "output_dir": Target("run.output_dir"),
    "batch_size": Target("packer.batch_size"), "token_batch_size": Target("packer.token_batch_size"),
    "micro_batch_size": lost("rlbus packs micro-batches of packer.seq_len tokens; trainer.forward_batch sets how "
                             "many go through one forward pass"),
    "oversampling_factor": Target("feeder.oversampling_factor"),
    "buffer.oversampling_factor": Target("feeder.oversampling_factor"),
    "max_inflight_rollouts": Target("feeder.max_inflight_rollouts"),
    "max_inflight_episodes": Target("feeder.max_inflight_rollouts"),
    "concurrency.max_inflight": Target("feeder.max_inflight_rollouts", "rollouts in flight, a fixed cap in rlbus"),
    "concurrency.initial_inflight": lost("no adaptive concurrency: feeder.max_inflight_rollouts is a fixed cap"),
    "concurrency.min_inflight": lost("no adaptive concurrency: feeder.max_inflight_rollouts is a fixed cap"),
    "group_size": Target("group_size"), "rollouts_per_example": Target("group_size"),
    "rollouts_per_prompt": Target("group_size", "prime-rl's 2025 name"),
    "seq_len": Target("packer.seq_len", "rlbus packs samples into micro-batches of this many tokens"),
    "max_off_policy_steps": Target("packer.max_off_policy_steps", "counted the same way (0 = strictly on-policy)"),
    "async_level": Target("packer.max_off_policy_steps", "prime-rl's 2025 name of max_off_policy_steps"),
    "max_async_level": Target("packer.max_off_policy_steps", "prime-rl's 2025 name of max_off_policy_steps"),
    "mask_truncated_completions": Target("packer.post_batch_filters", "true adds the truncated filter to rlbus's "
                                         "default post-batch filters; false is rlbus's default", value=truncated),
    "zero_truncated_completions": lost("truncated samples are dropped (the truncated filter), not given reward 0"),
    "tasks_per_minute": Target("rollout.tasks_per_minute"), "bench": Target("bench"),
    "training_mode": Target("training_mode"),
    "num_train_workers": Target("trainer.nproc", "data-parallel trainer ranks"),
    "optim.lr": Target("trainer.lr"),
    "model.name": Target("model.path", "a local folder or a hub id, as transformers reads it"),
    "student.name": Target("model.path", "[student] is [model] in rlbus"),
    "student.model.name": Target("model.path", "[student] is [model] in rlbus"),
    "model.client.base_url": Target("inference.base_urls", value=as_list),
    "model.client.api_key_var": Target("inference.api_key_var"),
    "model.client.headers_from_env": Target("inference.headers_from_env", whole=True),
    "model.client.timeout": Target("inference.request_timeout_s"),
    "model.lora.name": Target("model.lora.name"), "model.lora.rank": Target("model.lora.rank"),
    "model.lora.alpha": Target("model.lora.alpha"),
    "lora_name": Target("model.lora.name"),
    "teacher.model.name": Target("teacher.path"),
    "teacher.client.base_url": Target("teacher.base_urls", value=as_list),
    "teacher.client.api_key_var": Target("teacher.api_key_var"),
    "teacher.client.headers_from_env": Target("teacher.headers_from_env", whole=True),
    "algo.teacher.name": Target("teacher.path"), "algo.teacher.base_url": Target("teacher.base_urls", value=as_list),
    "algo.sampling.source.name": Target("teacher.path", "the model sft samples come from"),
    "algo.sampling.source.base_url": Target("teacher.base_urls", value=as_list),
    "algo.type": Target("training_mode", "grpo → rl; opd; sft", value=mode),
    "train.max_retries": Target("max_retries"),
    "train.filter_zero_advantages": Target("packer.post_batch_filters", "true: rlbus's default post-batch "
                                           "zero_advantage filter drops them; false: that filter only counts",
                                           value=lambda on: None if on else [
                                               {"type": "gibberish"}, {"type": "repetition"},
                                               {"type": "zero_advantage", "enforce": False}]),
    "environment.id": Target("env[0].id", "prime-rl's 2025 single [environment]; a verifiers v0 id does not run "
                             "until it is replaced"),
    "environment.args": Target("env[0].args", whole=True),
    **{f"env.{k}": Target(f"env[0].{k}", "a single [orchestrator.env] table of the verifiers form: 1:1", whole=True)
       for k in ("taskset", "agent")},
    "eval.interval": Target("eval.interval"), "eval.num_examples": Target("eval.num_examples"),
    "eval.group_size": Target("eval.group_size"),
    "eval.rollouts_per_example": Target("eval.group_size", each="eval.env[].group_size"),
    "eval.rollouts_per_prompt": Target("eval.group_size", each="eval.env[].group_size"),
    "eval.environment_ids": Target(None, each="eval.env[].id"),
    "eval.benchmarks": Target(None, each="eval.env[].id"),
    "eval.max_retries": Target("eval.max_retries"), "eval.skip_first_step": Target("eval.skip_first_step"),
    "pre_batch_filters": Target("filter.pre_batch_filters", "same filter types and knobs", whole=True),
    "post_batch_filters": Target("packer.post_batch_filters", "same filter types and knobs", whole=True),
    "filters": Target("packer.post_batch_filters", "same filter types and knobs", whole=True),
    "ckpt.interval": Target("ckpt.interval"), "ckpt.resume_step": Target("ckpt.resume_step"),
    "ckpt.wait_for_weights_timeout": Target("ckpt.wait_for_weights_timeout"),
    "ckpt.keep_last": Target("ckpt.keep_last"), "ckpt.keep_interval": Target("ckpt.keep_interval"),
    "ckpt.skip_progress": Target("ckpt.skip_progress"),
    "ckpt": same(FINAL_CHECKPOINT),
    "log.level": Target("log.level"),
    "wandb.project": Target("wandb.project"), "wandb.name": Target("wandb.name"),
    "monitor.wandb.project": Target("wandb.project"), "monitor.wandb.name": Target("wandb.name"),
    "monitors.wandb.project": Target("wandb.project"), "monitors.wandb.name": Target("wandb.name"),
    "weight_broadcast.type": Target("trainer.weight_transport", "filesystem → safetensors", value=transport),
    "weight_broadcast.host": Target("trainer.nccl_host"), "weight_broadcast.port": Target("trainer.nccl_port"),
    "weight_broadcast.timeout": Target("trainer.broadcast_timeout_s"),
    "weight_broadcast.inference_world_size": Target("trainer.inference_world_size"),
    "weight_broadcast.quantize_in_weight_transfer": lost("weights travel in the training dtype"),
    "renderer.name": Target(None, "\"default\" (the chat template) is what rlbus does", value=renderer),
}

_LEFT = {
    "tokenizer": "the tokenizer is the one in model.path",
    "renderer": "rlbus applies the model's own chat template and keeps the token ids it sampled",
    "use_renderer": "rlbus applies the model's own chat template and keeps the token ids it sampled",
    "use_token_client": "rlbus always sends token ids to its servers",
    "pool_size": "no renderer pool: tokenization happens once per turn in the rollout worker",
    "env_vars": "set the environment of each worker process (compose, Kubernetes) instead",
    "prime_monitor": "no Prime monitor service; metrics go to metrics.jsonl and W&B",
    "monitors.prime": "no Prime monitor service; metrics go to metrics.jsonl and W&B",
    "heartbeat": "no BetterStack heartbeat; inference servers heartbeat in Redis",
    "collect_inference_metrics": "inference server metrics are not collected",
    "inference_metrics_roles": "inference server metrics are not collected",
    "rollout_transport": "Redis streams are the transport", "client": "the client is [inference]'s",
    "model.client.elastic": "no elastic inference pool: list the servers in inference.base_urls",
    "experimental": "no experimental section", "multimodal": "text only", "model.vlm": "text only",
    "model.trust_remote_code": "models load with transformers' defaults (no remote code)",
    "algo.length_penalty": "rlbus's length penalty is one number per completion token (filter.advantage."
                           "length_penalty)",
    "algo.roles": "advantages are per sample (filter.advantage), not per role",
    "algo.demo_key": "sft from an env's reference answers is env[].sft_source = \"reference\"",
    "algo.sampling": "sft samples come from [teacher] (its path and base_urls carry over)",
    "advantage": "advantages are set in filter.advantage (GRPO-style)",
    "buffer": "no difficulty buffer: the feeder samples uniformly (or by env ratio)",
    "env_mix": "env mixing is each [[env]]'s ratio",
    "data": "an env's dataset is its factory's (env[].args)", "val": "no validation split: use [[eval.env]]",
    "teacher_rollout_model": "sft samples come from [teacher] (teacher.api = \"chat\" for a hosted model)",
    "use_sft_loss": "sft is an env mode (training_mode = \"sft\")",
    "trajectory_strategy": "rlbus trains on each turn's sampled tokens",
    "toml_files": "prime-rl's file includes: give the files to `rlbus config convert` together",
    "eval.eval_base_model": "the step-0 eval (eval.skip_first_step = false) is the base model's",
    "eval.retrigger_on_resume": "an eval runs at eval.interval steps only",
    "wandb.log_extras": "samples and distributions are not logged to W&B; see metrics.jsonl",
    "monitor.wandb.log_extras": "samples and distributions are not logged to W&B; see metrics.jsonl",
    "monitor.wandb.log_samples": "samples are not logged to W&B; `rlbus inspect` reads them",
    "wandb.entity": "rlbus's W&B section has project, name and mode", "wandb.group": "no W&B groups",
    "wandb.tags": "no W&B tags", "wandb.shared": "no shared W&B runs",
    "env_server_base_port": "env servers are spawned by rollout workers (or at env[].address)",
    "pad_to_multiple_of": "micro-batches are packed to packer.seq_len",
    "resume": "rlbus run resumes from the newest checkpoint by default (ckpt.resume_step)",
    "log.vf_level": "one log level (log.level)", "log.json_logging": "set log.json",
}

_SHARED = {
    "max_steps": Target("run.max_steps"), "seq_len": Target("packer.seq_len"),
    "output_dir": Target("run.output_dir"), "run.name": Target("run.name"),
    "model.name": Target("model.path", "a local folder or a hub id, as transformers reads it"),
    "wandb.project": Target("wandb.project"), "wandb.name": Target("wandb.name"),
    "wandb.offline": Target("wandb.mode", value=wandb_mode),
    "monitors.wandb.project": Target("wandb.project"), "monitors.wandb.name": Target("wandb.name"),
    "monitors.wandb.offline": Target("wandb.mode", value=wandb_mode),
    "monitor.wandb.project": Target("wandb.project"),
    "ckpt.interval": Target("ckpt.interval"), "ckpt.keep_last": Target("ckpt.keep_last"),
    "ckpt.keep_interval": Target("ckpt.keep_interval"), "ckpt.resume_step": Target("ckpt.resume_step"),
    "ckpt": same(FINAL_CHECKPOINT),
    "resume.step": Target("ckpt.resume_step"),
    "optim.lr": Target("trainer.lr"),
    "max_async_level": Target("packer.max_off_policy_steps", "prime-rl's 2025 name of max_off_policy_steps"),
    "infer": lost("vLLM knobs: pass them as flags in inference.vllm_args"),
    "resume": same("rlbus run resumes from the newest checkpoint by default"),
    "log.level": Target("log.level"),
    "weight_broadcast.type": Target("trainer.weight_transport", "filesystem → safetensors", value=transport),
    "weight_broadcast.port": Target("trainer.nccl_port"),
    "weight_broadcast.timeout": Target("trainer.broadcast_timeout_s"),
    "weight_broadcast.quantize_in_weight_transfer": lost("weights travel in the training dtype"),
    "inference": same("rlbus run starts the inference servers itself (inference.servers)"),
    "trainer": same("rlbus run starts the trainer itself"),
    "clean": lost("rlbus run starts fresh unless a checkpoint is there; delete run.output_dir to clean"),
    "clean_output_dir": lost("rlbus run starts fresh unless a checkpoint is there; delete run.output_dir to clean"),
    "deployment": Target(None, "one trainer GPU and one inference GPU is what rlbus run starts", value=placement),
    "slurm": lost("no Slurm launcher: rlbus run on one machine; the workers run under any scheduler"),
    "inference_gpu_ids": lost("GPUs are given per process (CUDA_VISIBLE_DEVICES) by the launcher"),
    "trainer_gpu_ids": lost("GPUs are given per process (CUDA_VISIBLE_DEVICES) by the launcher"),
    "num_train_nodes": lost("placement is the launcher's"), "num_infer_nodes": lost("placement is the launcher's"),
    "env_vars": lost("set the environment of each worker process instead"),
    "job_name": lost("no Slurm launcher: rlbus run on one machine; the workers run under any scheduler"),
    "monitors.prime": lost("no Prime monitor service; metrics go to metrics.jsonl and W&B"),
    "monitors.file": same("every run writes metrics.jsonl in run.output_dir"),
    "model.vlm": lost("text only"), "model.ac": lost("activation checkpointing is not in rlbus's trainer"),
    "model.reshard": lost("no FSDP resharding in rlbus's trainer"),
    "model.trust_remote_code": lost("models load with transformers' defaults (no remote code)"),
    **{f"wandb.{k}": lost(r) for k, r in (("entity", "rlbus's W&B section has project, name and mode"),
                                          ("group", "no W&B groups"), ("tags", "no W&B tags"),
                                          ("shared", "no shared W&B runs"))},
}
"""The top level of a combined ``rl.toml``, shared by its three parts."""

_TRAINER = {
    "optim.lr": Target("trainer.lr"), "optim.weight_decay": Target("trainer.weight_decay"),
    "optim.max_norm": Target("trainer.max_grad_norm"),
    "scheduler.warmup_steps": Target("trainer.warmup_steps"),
    "model.lora.rank": Target("model.lora.rank"), "model.lora.alpha": Target("model.lora.alpha"),
    "model.lora.dropout": Target("model.lora.dropout"),
    "model.lora.target_modules": Target("model.lora.target_modules"),
    "model.name": Target("model.path"), "max_steps": Target("run.max_steps"),
    "ckpt.interval": Target("ckpt.interval"), "ckpt.keep_last": Target("ckpt.keep_last"),
    "weight_broadcast.type": Target("trainer.weight_transport", "filesystem → safetensors", value=transport),
    "optim.type": Target(None, "AdamW is rlbus's optimiser", value=adamw),
    "model.compile": Target("trainer.compile", "an empty [trainer.model.compile] turns torch.compile on",
                            value=lambda v: True if v == {} else v),
    "loss": lost("rlbus's losses are trainer.loss (dppo, cispo, ppo, custom) with their own knobs"),
    "model": lost("the trainer's model knobs (parallelism, kernels, compile) are prime-rl's FSDP trainer's"),
    "optim": lost("rlbus's optimiser is AdamW: trainer.lr, betas, weight_decay, max_grad_norm"),
    "scheduler": lost("rlbus's schedules are constant and cosine (trainer.schedule, warmup_steps)"),
    "data": lost("the trainer reads batches from the packer"),
    "micro_batch_size": lost("rlbus packs micro-batches of packer.seq_len tokens"),
    "toml_files": lost("prime-rl's file includes: give the included files to `rlbus config convert` as well"),
    **{f"{m}.{k}": Target(f"wandb.{k}") for m in ("wandb", "monitor.wandb", "monitors.wandb")
       for k in ("project", "name")},
    "wandb.log_extras": lost("samples and distributions are not logged to W&B; see metrics.jsonl"),
    "monitor.wandb.log_extras": lost("samples and distributions are not logged to W&B; see metrics.jsonl"),
    "ckpt": same(FINAL_CHECKPOINT),
    "ckpt.resume_step": Target("ckpt.resume_step"), "ckpt.keep_interval": Target("ckpt.keep_interval"),
    "ckpt.skip_optimizer": lost("every rlbus checkpoint holds the optimiser state"),
    "ckpt.weights": lost("published weights are trainer.weight_transport's; adapters alone with model.lora"),
    "ckpt.weights.save_adapter_separately": same("with model.lora rlbus saves the adapter alone (`rlbus export` "
                                                 "merges it)"),
    "ckpt.skip_gather_master_weights": lost("no FSDP master weights in rlbus's trainer"),
    "dist_timeout_seconds": lost("no torch.distributed timeout setting"),
    "enable_router_replay": lost("no MoE router replay in rlbus's trainer"),
    "enable_token_export": lost("no token export"),
}
"""``[trainer]`` (or a split trainer file): the learning rate and LoRA carry over, prime-rl's FSDP knobs do not."""

PRIME_RL: dict[str, Target] = {
    **_SHARED,
    **{ORCH + k: t for k, t in _ORCHESTRATOR.items()},
    **{ORCH + k: lost(r) for k, r in _LEFT.items()},
    **_sampling(ORCH + "train.sampling", "sampling"), **_sampling(ORCH + "sampling", "sampling"),
    **_sampling(ORCH + "eval.sampling", "eval.sampling", evals=True),
    **env_table(ENV),
    **{f"trainer.{k}": t for k, t in _TRAINER.items()},
    "inference": same("rlbus run starts the inference servers itself (inference.servers)"),
    "inference.model.name": Target("model.path"),
    "inference.server.port": Target("inference.port"), "inference.server.host": Target("inference.host"),
    "inference.model.max_model_len": Target("inference.max_model_len"),
    "inference.parallel.tp": flag("--tensor-parallel-size"),
    "inference.parallel.dp": flag("--data-parallel-size"),
    "inference.gpu_memory_utilization": flag("--gpu-memory-utilization"),
    "inference.model.enforce_eager": flag("--enforce-eager"),
    "inference.model.tool_call_parser": flag("--tool-call-parser"),
    "inference.model.enable_auto_tool_choice": flag("--enable-auto-tool-choice"),
    "inference.model.dtype": flag("--dtype"),
    "inference.parallel": lost("vLLM parallelism: pass its flags in inference.vllm_args"),
    "inference.vllm": Target("inference.vllm_args", "prime-rl passes these to vLLM verbatim: each becomes its flag; "
                             "vllm_args apply with inference.backend = \"vllm\"", value=vllm_flags, whole=True,
                             append=True),
    "inference.model": lost("vLLM model knobs: pass them as flags in inference.vllm_args"),
    "inference.enable_lora": same("rlbus's servers load the adapter when model.lora is set"),
    "inference.env_vars": lost("set the environment of each worker process instead"),
    "inference.deployment": lost("placement is the launcher's: rlbus run on one machine, compose or Kubernetes "
                                 "across many"),
}
"""prime-rl (every layout since 2025-07, as a combined ``rl.toml``) → rlbus."""

FALLBACK = {
    "trainer.": "a knob of prime-rl's FSDP trainer; rlbus's trainer has no such setting ([trainer] lists its own)",
    "inference.": "a vLLM engine or serving knob: pass vLLM flags in inference.vllm_args",
    "": "no rlbus equivalent (a field the prime-rl table does not know)",
}
"""The reason for a field no row names, by where it sits."""

PRIME_RL_VERIFIERS = {**PRIME_RL, **env_table(VERIFIERS_ENV)}
"""The same, for the fields of a verifiers-form env block."""

DEFAULTS: list[tuple[str, str, Any, str]] = [
    (ORCH + "group_size", "group_size", 1, "prime-rl's default rollouts per example; rlbus's is 8"),
    (ORCH + "train.sampling.max_completion_tokens", "sampling.max_completion_tokens", None,
     "prime-rl's default is no per-turn cap (until EOS or the context limit): written as seq_len; rlbus's is 128"),
    ("trainer.optim.lr", "trainer.lr", 1e-6, "prime-rl's default learning rate; rlbus's is 1e-4"),
    ("model.name", "model.path", "Qwen/Qwen3-0.6B", "prime-rl's default model; rlbus's is a random-init tiny one"),
    ("wandb.project", "wandb.project", "prime-rl", "prime-rl's default W&B project (when W&B is on)"),
    ("wandb.offline", "wandb.mode", "online", "prime-rl logs to W&B online by default; rlbus's default is offline "
     "(when W&B is on)"),
    (ORCH + "train.source[].ratio", "env[].ratio", 1.0, "prime-rl weighs each source 1.0 by default (equal per env); "
     "rlbus's default samples uniformly over examples"),
]
"""(prime-rl field, rlbus key, prime-rl's default, why it is written) for defaults that differ: written where the
source leaves the field unset (a ``wandb.*`` one only when W&B is on; ``[]``: on each source)."""
