"""Where each argument of ART's ``PipelineTrainer(...)`` (and of its ``pipeline=PipelineRuntimeConfig(...)``) lives
in rlbus, following ART's current signature; the names ART has since renamed or moved are kept as aliases where
they still mean the same (``eval_step_0``, ``kl_penalty_reference_step``, the direct batch and worker settings).
ART's settings are Python arguments, not a file, so nothing converts them: ``docs/configuration.md`` prints this
table.
"""

from workers.tools.migration import Target, lost, same

_PIPELINE = {
    "num_rollout_workers": Target("rollout.max_concurrent_groups", "groups in flight per rollout worker; "
                                  "rollout.workers adds processes"),
    "min_batch_size": Target("packer.batch_size", "in samples (ART counts groups: min_batch_size × group_size)"),
    "max_batch_size": Target("packer.max_batch_size", "in samples; None takes batch_size every step (ART: 10 × "
                             "min_batch_size)"),
    "max_steps_off_policy": Target("packer.max_off_policy_steps", "counted the same way (0 = strictly on-policy); "
                                   "ART's default is 4, rlbus's 8"),
    "queue_maxsize": Target("feeder.max_inflight_rollouts", "in samples"),
    "score_reference_groups_per_step": lost("no autotuner: the batch and in-flight sizes are fixed settings"),
    "score_reference_rollouts_per_group": lost("no autotuner: the batch and in-flight sizes are fixed settings"),
}

ART: dict[str, Target] = {
    "model": Target("model.path", "a local folder or a hub id"),
    "backend": Target("inference.backend", "transformers (built-in) or vllm; training runs in `rlbus trainer`"),
    "rollout_fn": Target("env[].id", "an env: `package.module:factory` returning initial/step/score"),
    "scenarios": Target("env[].args", "the env's dataset, built by its factory from args"),
    "config": Target("env[].args"),
    "eval_fn": Target("eval.env", "eval environments ([[eval.env]])"),
    **{f"pipeline.{k}": t for k, t in _PIPELINE.items()},
    **{k: Target(t.key, f"{t.note}; ART: deprecated alias of pipeline.{k}" if t.key else t.note)
       for k, t in _PIPELINE.items() if k != "score_reference_rollouts_per_group"},
    "autotune": lost("no autotuner: the batch and in-flight sizes are fixed settings"),
    "learning_rate": Target("trainer.lr", "ART's default is 1e-5, rlbus's 1e-4"),
    "loss_fn": Target("trainer.loss.type", "cispo (ART's default), ppo, dppo (rlbus's default) or custom"),
    "loss_fn_config": Target("trainer.loss", "the chosen loss's knobs"),
    "normalize_advantages": Target("filter.advantage.std_normalize", "off by default in rlbus (Dr. GRPO); ART's "
                                   "default is on"),
    "grad_accumulation_sequences": lost("rlbus takes one optimiser step per batch, accumulating all its "
                                        "micro-batches"),
    "adam_params": Target("trainer.betas", "with trainer.weight_decay"),
    "kl_penalty_coef": Target("trainer.kl_penalty_coef"),
    "kl_penalty_step_lag": lost("the KL reference is fixed: the initial weights or one step's "
                                "(trainer.kl_penalty_reference_step), not the policy a number of steps back"),
    "kl_penalty_reference_step": Target("trainer.kl_penalty_reference_step", "ART's earlier name; a fixed step"),
    "max_steps": Target("run.max_steps"),
    "discard_queue_multiplier": Target("packer.collapse_after", "zero-variance groups in a row that stop the run; "
                                       "default 100 × the batch in groups, as ART's"),
    "limit_mean_steps_off_policy": lost("staleness is bounded per sample (packer.max_off_policy_steps), not on "
                                        "average"),
    "log_interval_seconds": Target("status.log_interval_seconds"),
    "status_ewa_alpha": Target("status.ewa_alpha"),
    "total_scenarios": same("the env reports its dataset size"),
    "eval_every_n_steps": Target("eval.interval", "ART's default is 20, rlbus's 100"),
    "eval_at_start": Target("eval.skip_first_step", "inverted"),
    "eval_step_0": Target("eval.skip_first_step", "ART's earlier name of eval_at_start; inverted"),
    "save_checkpoint": Target("ckpt.interval", "ART saves every step when true; rlbus checkpoints every "
                              "ckpt.interval steps (None: at the end only)"),
    "optimizer_save_interval": same("every rlbus checkpoint holds the optimiser state"),
    "checkpoint_retention_strategy": Target("ckpt.keep_last", "keep the newest N (with ckpt.keep_interval: also "
                                            "every Nth step)"),
    "checkpoint_retention_interval": Target("ckpt.keep_interval"),
    "resume": Target("ckpt.resume_step", "-1 resumes from the newest checkpoint (rlbus run's default)"),
    "rollout_executor": Target("rollout.workers", "rollout worker processes, on any machine that reaches Redis"),
}
"""ART's ``PipelineTrainer(...)`` arguments (``pipeline.*``: its ``PipelineRuntimeConfig``) → rlbus."""
