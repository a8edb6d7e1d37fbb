"""The run's configuration: one TOML file, one pydantic model per section (the env, batching and model sections
live in :mod:`workers.env_config`, :mod:`workers.batch_config` and :mod:`workers.model_config`).

Every worker loads the whole file and reads the sections it needs. Unknown keys are errors;
validators check and explain; one, ``RlbusConfig._resolve``, writes what envs inherit (and what
``bench`` implies) into them, as prime-rl's do; other derived values come from the methods at the
bottom of :class:`RlbusConfig`.
"""

import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, model_validator

from bus.config import LogConfig, RedisConfig, Section
from bus.messages import Mode
from trainer.config import CkptConfig, TrainerConfig
from workers.batch_config import FeederConfig, FilterConfig, PackerConfig
from workers.concurrency_config import ConcurrencyConfig
from workers.env_config import (
    EnvConfig,
    EvalConfig,
    EvalEnvConfig,
    EvalSamplingConfig,
    SamplingConfig,
    check_unique_names,
    inherit,
)
from workers.model_config import ModelConfig, TeacherConfig
from workers.monitor_config import ExporterConfig, StatusConfig, WandbConfig
from workers.slurm_config import SlurmConfig


class RunConfig(Section):
    name: str = Field("default", pattern=r"^[A-Za-z0-9._-]+$")
    """Run name; every Redis key of the run starts with ``rlbus:{NAME}:``."""

    output_dir: Path = Path("outputs/default")
    """Directory for weights, checkpoints, metrics.jsonl, summary.json and report.png."""

    seed: int = 0
    """Seed for dataset shuffling, sampling and model init."""

    max_steps: int | None = Field(None, ge=1)
    """Training steps to run; None runs until stopped."""


class RolloutConfig(Section):
    workers: int = Field(1, ge=1)
    """Rollout worker processes ``rlbus run`` starts."""

    max_concurrent_groups: int = Field(4, ge=1)
    """Groups one worker rolls out at once; with ``concurrency.adaptive`` the limit it starts at."""

    concurrency: ConcurrencyConfig = Field(default_factory=ConcurrencyConfig)
    """Adaptive concurrency: the limit moved with the inference servers' load."""

    tasks_per_minute: int | None = Field(None, ge=1)
    """Rate limit per worker; None = unlimited."""

    env_timeout_s: float = Field(30.0, gt=0)
    """Timeout of one env-server RPC."""

    retry_delay_s: float = Field(1.0, ge=0)
    """Delay before a failed rollout is retried."""

    curve_dir: str | None = None
    """Folder of the CURVE keys (``bus/curve.py``) of the env servers at ``tcp://`` addresses, which the rollout
    workers and the feeder use to reach them (start each with ``rlbus env --curve-dir`` the same folder). ``rlbus
    run`` sets it to ``OUTPUT_DIR/curve``, generating the keys there once, when an env has a ``tcp://`` address.
    None: plain ZeroMQ, which any peer that reaches the port can use."""


class InferenceConfig(Section):
    backend: Literal["transformers", "vllm"] = "transformers"
    """Server to run: the built-in transformers server or vLLM."""

    servers: int = Field(1, ge=1)
    """Inference servers ``rlbus run`` starts (ports port, port+1, …)."""

    host: str = "127.0.0.1"
    """Address the server binds."""

    port: int = Field(8000, ge=1, le=65535)
    """Port of the first server."""

    base_urls: list[str] = Field(default_factory=list)
    """Servers the clients use (``http://host:port/v1``); empty = ``servers`` servers at host:port, port+1, …"""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the built-in server."""

    max_batch_size: int = Field(64, ge=1)
    """Sequences decoded together in one forward pass."""

    max_model_len: int = Field(2048, ge=16)
    """Longest prompt + completion the server accepts."""

    batch_wait_ms: float = Field(20.0, ge=0, le=1000)
    """Built-in server: how long an idle engine holds the first request that reaches it for others to prefill and
    decode with it (a rollout worker's groups, sent together, arrive a few ms apart; each separate wave costs forward
    passes). A queue holding ``max_batch_size`` sequences starts at once; 0: never wait (lowest latency)."""

    max_queued_sequences: int = Field(4096, ge=1)
    """Built-in server: sequences (prompts × ``n``) that may wait for a batch slot beyond the running batch; a
    request that would queue more is answered 429 with ``Retry-After`` (the client retries), one asking for more
    than this on its own 400. Bounds what a flood of requests costs (~4 KB per one-token sequence)."""

    num_threads: int | None = Field(None, ge=1)
    """torch CPU threads of the server (vLLM: its OpenMP threads, its worker then not pinned to cores); None = the
    share ``rlbus run`` assigns (a server started on its own keeps the environment's settings)."""

    request_timeout_s: float = Field(300.0, gt=0)
    """Client timeout of one request."""

    max_retries: int = Field(3, ge=0)
    """Client retries (with exponential backoff) of a failed request."""

    api_key_var: str | None = None
    """Environment variable holding the API key (never the key itself: the TOML may be shared): the clients send it
    as ``Authorization: Bearer KEY``, and the servers ``rlbus inference`` starts (built-in, or vLLM as its
    ``--api-key``) refuse a ``/v1`` request without it (401; ``/health`` stays open). None: no key."""

    headers_from_env: dict[str, str] = Field(default_factory=dict)
    """HTTP header name → environment variable holding its value."""

    vllm_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for the vLLM server."""

    vllm_weight_transfer: Literal["auto", "native", "extension"] = "auto"
    """How vLLM takes new weights: ``native`` through vLLM's weight-transfer API (``/start_weight_update``,
    ``/update_weights``, ``/finish_weight_update``, rlbus's ``rlbus`` engine), ``extension`` through rlbus's worker
    extension (``/collective_rpc``); ``auto``: native where the installed vLLM has the API, else the extension."""


BENCH_STEPS = 4
"""Steps of a ``bench = true`` run (prime-rl's: one warm-up step and three measured ones)."""

def deep_merge(base: dict, update: dict) -> dict:
    """``update`` merged into a copy of ``base``: tables recursively, everything else replaced."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


_ALIASES = {"student": "model", "teacher_model": "teacher"}
"""Section names of prime-rl's training-modes change, read as rlbus's own (with a deprecation warning)."""


class RlbusConfig(Section):
    """The whole run configuration (one TOML file)."""

    group_size: int = Field(8, ge=1, validation_alias=AliasChoices("group_size", "rollouts_per_example"))
    """Default completions per example of every [[env]] that sets none (prime-rl's ``rollouts_per_example``)."""

    max_retries: int = Field(3, ge=0)
    """Default retries of a failed rollout for every [[env]] that sets none."""

    training_mode: Mode = "rl"
    """Default ``mode`` of every [[env]] that sets none: rl, opd or sft."""

    bench: bool = False
    """Benchmark mode (prime-rl's): run 4 steps (one warm-up, three measured), no eval, no W&B, then print step
    time, tokens/s and trainer idle time."""

    run: RunConfig = Field(default_factory=RunConfig)
    """The run's name, output directory, seed and length."""
    redis: RedisConfig = Field(default_factory=RedisConfig)
    """Where the run's streams live and how workers read them."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy being trained (prime-rl's ``[student]`` is read as this)."""
    teacher: TeacherConfig | None = None
    """The teacher of opd and sft envs (prime-rl's ``[teacher_model]`` is read as this); None: no teacher."""
    env: list[EnvConfig] = Field(default_factory=list)
    """Training environments (``[[env]]``)."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Training sampling shared by every env (each may override fields)."""
    feeder: FeederConfig = Field(default_factory=FeederConfig)
    """Turning datasets into tasks: the in-flight cap, shuffling, epochs."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout workers: processes, concurrency, rate limits, retries."""
    filter: FilterConfig = Field(default_factory=FilterConfig)
    """Advantages and the pre-batch sample filters."""
    packer: PackerConfig = Field(default_factory=PackerConfig)
    """Steps: batch sizes, staleness, packing, the post-batch filters."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Optimisation, losses, weight publication."""
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    """The policy's inference servers and their clients."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Evaluation environments, schedule and sampling."""
    ckpt: CkptConfig = Field(default_factory=CkptConfig)
    """Trainer checkpoints and resuming."""
    log: LogConfig = Field(default_factory=LogConfig)
    """Log level and format of every worker."""
    status: StatusConfig = Field(default_factory=StatusConfig)
    """What ``rlbus run`` prints off a terminal."""
    exporter: ExporterConfig = Field(default_factory=ExporterConfig)
    """The Prometheus exporter (``rlbus exporter``, and the one ``rlbus run`` serves)."""
    wandb: WandbConfig | None = None
    """Weights & Biases logging by ``rlbus run``; None: off."""
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    """How ``rlbus slurm`` asks a Slurm cluster for nodes and places the roles on them."""
    stage: list["StageConfig"] = Field(default_factory=list)
    """Stages ``rlbus run`` runs one after another (``[[stage]]``, e.g. SFT then RL); empty: one run. Each
    ``[[stage]]`` table holds a ``name`` and any sections, merged over this file's (``[stage.trainer]`` …;
    its ``[[stage.env]]`` replaces ``[[env]]``); ``--stage.1.run.max_steps 50`` overrides one stage."""

    @model_validator(mode="before")
    @classmethod
    def _stages(cls, data: Any) -> Any:
        """Each raw ``[[stage]]`` table becomes its stage's whole config: the top level with the table merged over
        it, in ``output_dir/NAME`` as run ``RUN-NAME`` unless the table says otherwise."""
        if not isinstance(data, dict) or not data.get("stage"):
            return data
        base = {k: v for k, v in data.items() if k != "stage"}
        run = {**RunConfig().model_dump(), **base.get("run", {})}
        stages = []
        for i, table in enumerate(data["stage"]):
            if not isinstance(table, dict):
                raise ValueError(f"stage.{i} must be a table ([[stage]] with a name), not {table!r}")
            if "config" in table:  # a stage already expanded: a validated config dumped and read back
                stages.append(table)
                continue
            table = dict(table)
            name = table.pop("name", None)
            named = {**table.get("student", {}), **table.get("model", {})}  # prime-rl's [student] is [model]
            from_previous = table.pop("from_previous", i > 0 and "path" not in named)
            own = {"name": f"{run['name']}-{name}", "output_dir": str(Path(run["output_dir"]) / str(name))}
            merged = deep_merge(deep_merge(base, {"run": own}), table)
            stages.append({"name": name, "from_previous": from_previous, "config": merged})
        return {**data, "stage": stages}

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for alias, name in _ALIASES.items():
            if alias in data:
                if name in data:
                    raise ValueError(f"[{alias}] and [{name}] are the same section; keep [{name}] only")
                warnings.warn(f"[{alias}] is deprecated in rlbus, use [{name}] (read as [{name}] for now)",
                              FutureWarning, stacklevel=2)
                data = {(name if k == alias else k): v for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _resolve(self) -> "RlbusConfig":
        """Per-env inheritance (group_size, max_retries, mode, sampling and advantage, field by field) and bench
        mode, resolved once so that every worker and ``config.resolved.toml`` see the effective values."""
        for env in self.env:
            if "mode" not in env.model_fields_set:
                env.mode = self.training_mode
            reference = env.mode == "sft" and env.sft_source == "reference"
            for field, value in (("group_size", 1 if reference else self.group_size),
                                 ("max_retries", self.max_retries)):
                if field not in env.model_fields_set:
                    setattr(env, field, value)
            env.sampling = inherit(self.sampling, env.sampling)
            env.advantage = inherit(self.filter.advantage, env.advantage)
        if self.bench:
            self.run.max_steps = BENCH_STEPS
            self.eval.env = []
            self.wandb = None
        return self

    @model_validator(mode="after")
    def _check(self) -> "RlbusConfig":
        check_unique_names(self.env, "env", "[[env]]")
        names = [stage.name for stage in self.stage]
        if len(set(names)) < len(names):
            raise ValueError(f"[[stage]] names must differ, got {names}")
        if self.stage and self.stage[0].from_previous:
            raise ValueError(f"stage {names[0]!r} is the first; it has no previous stage to start from "
                             "(remove its from_previous)")
        for previous, stage in zip(self.stage, self.stage[1:], strict=False):
            if stage.from_previous and previous.config.trainer.weight_transport != "safetensors":
                raise ValueError(f"stage {stage.name!r} starts from stage {previous.name!r}'s last weights, but "
                                 f"{previous.name!r} broadcasts its weights (trainer.weight_transport = "
                                 f"{previous.config.trainer.weight_transport!r}) and writes no weights folder; set it "
                                 "to \"safetensors\" there, or give this stage a model.path")
        for previous, stage in zip(self.stage, self.stage[1:], strict=False):
            if stage.from_previous and previous.config.model.lora is not None:
                raise ValueError(f"stage {stage.name!r} starts from stage {previous.name!r}'s last weights, but "
                                 f"{previous.name!r} trains a LoRA adapter (its weights folders hold only the "
                                 "adapter); give this stage a model.path made with `rlbus export` of that stage")
        if self.model.lora is not None:
            if self.trainer.weight_transport != "safetensors":
                raise ValueError("model.lora publishes adapter files (a few MB) to the shared folder; set "
                                 "trainer.weight_transport = \"safetensors\"")
            if self.trainer.kl_penalty_reference_step is not None:
                raise ValueError("model.lora with trainer.kl_penalty_reference_step: the weights folders hold "
                                 "adapters, not models; unset it (the reference is then model.path)")
        ratios = [e.ratio for e in self.env]
        if any(r is None for r in ratios) and any(r is not None for r in ratios):
            raise ValueError("set ratio on every [[env]] or on none (got a mix of set and unset ratios)")
        for env in self.env:
            from_data = env.mode == "sft" and env.sft_source == "reference"
            if env.mode in ("opd", "sft") and not from_data and self.teacher is None:
                raise ValueError(f"env {env.resolved_name!r} has mode={env.mode!r}, which needs a [teacher] section"
                                 + (" (or sft_source = \"reference\" to train on the env's answers)"
                                    if env.mode == "sft" else ""))
            if env.mode == "opd" and self.teacher is not None and self.teacher.api == "chat":
                raise ValueError(f"env {env.resolved_name!r} has mode=\"opd\", which needs the teacher's logprob of "
                                 "every completion token: a chat endpoint does not give them; serve the teacher on "
                                 "/v1/completions with prompt_logprobs (vLLM or rlbus inference) and set teacher.api "
                                 "= \"completions\"")
            if env.kind == "openenv" and from_data:
                raise ValueError(f"env {env.resolved_name!r} is an OpenEnv env, which has no reference answers to "
                                 "train on; use sft_source = \"teacher\" (with a [teacher]) or mode = \"rl\"")
            if (env.kind == "verifiers" and env.mode == "sft" and not from_data and self.teacher is not None
                    and self.teacher.api == "chat"):
                raise ValueError(f"env {env.resolved_name!r} is a verifiers env in sft from a teacher, whose runs "
                                 "call the teacher on token ids (/inference/v1/generate): a chat endpoint cannot "
                                 "serve them; serve the teacher with vLLM or rlbus inference and set teacher.api = "
                                 "\"completions\", or train on the taskset's answers (sft_source = \"reference\")")
            if from_data and env.group_size != 1:
                raise ValueError(f"env {env.resolved_name!r} trains on its reference answers (sft_source = "
                                 f"\"reference\"), one sample per task: set its group_size = 1, not {env.group_size}")
        batch = self.packer.batch_size
        if batch is not None:
            for env in self.env:
                if batch % env.group_size:
                    raise ValueError(
                        f"packer.batch_size={batch} is not divisible by group_size={env.group_size} of env "
                        f"{env.resolved_name!r}; make batch_size a multiple of every group_size"
                    )
        factor, cap = self.feeder.oversampling_factor, self.feeder.max_inflight_rollouts
        if batch is not None and factor is not None and cap is not None:
            largest = max((e.group_size for e in self.env), default=1)
            if cap != max(largest, int(batch * factor)):
                raise ValueError(
                    f"feeder.max_inflight_rollouts={cap} conflicts with feeder.oversampling_factor={factor} × "
                    f"packer.batch_size={batch} (= {max(largest, int(batch * factor))}); set one of the two"
                )
        if self.packer.token_batch_size is not None:
            if self.feeder.max_inflight_rollouts is None:
                raise ValueError("packer.token_batch_size needs feeder.max_inflight_rollouts; set it")
            if self.feeder.oversampling_factor is not None:
                raise ValueError("feeder.oversampling_factor works with packer.batch_size only; remove it")
        inflight = self.max_inflight_rollouts()
        for env in self.env:
            if inflight < env.group_size:
                raise ValueError(
                    f"feeder.max_inflight_rollouts={inflight} is below group_size={env.group_size} of env "
                    f"{env.resolved_name!r}; raise it to at least one group"
                )
        return self

    # Derived values, computed in one visible place.

    def batch_size(self) -> int | None:
        """Samples per step (None with token batching)."""
        if self.packer.token_batch_size is not None:
            return None
        return self.packer.batch_size if self.packer.batch_size is not None else 128

    def max_inflight_rollouts(self) -> int:
        """Rollouts (samples) in flight between the feeder and the packer."""
        if self.feeder.max_inflight_rollouts is not None:
            return self.feeder.max_inflight_rollouts
        batch = self.packer.max_batch_size or self.batch_size() or 0  # room for a dynamic batch to grow
        factor = self.feeder.oversampling_factor if self.feeder.oversampling_factor is not None else 1.0
        largest = max((e.group_size for e in self.env), default=1)
        return max(largest, int(batch * factor) + largest - 1)

    def inference_urls(self) -> list[str]:
        """Base URLs of the policy's inference servers: ``inference.base_urls``, else the ``servers`` local ports."""
        cfg = self.inference
        return cfg.base_urls or [f"http://{cfg.host}:{cfg.port + i}/v1" for i in range(cfg.servers)]

    def env_sampling(self, env: EnvConfig) -> SamplingConfig:
        """Sampling of one train env (its own fields over [sampling], resolved at validation)."""
        return env.sampling

    def eval_sampling(self, env: EvalEnvConfig) -> EvalSamplingConfig:
        """Eval sampling of one eval env (its own fields over [eval.sampling], resolved at validation)."""
        return env.sampling

    def eval_interval(self, env: EvalEnvConfig) -> int:
        """Steps between evals of one eval env (its own, else [eval].interval)."""
        return env.interval

    def collapse_after(self) -> int:
        """Consecutive zero-variance groups that stop the run (ART's 100 × minimum batch, in groups)."""
        if self.packer.collapse_after is not None:
            return self.packer.collapse_after
        group = min((e.group_size for e in self.env), default=1)
        batch = self.batch_size() or self.max_inflight_rollouts()
        return 100 * max(1, batch // group)

    def env_by_name(self, name: str) -> EnvConfig:
        """The [[env]] called ``name``; the error lists the names there are."""
        for env in self.env:
            if env.resolved_name == name:
                return env
        raise KeyError(f"no env named {name!r}; envs are {[e.resolved_name for e in self.env]}")


class StageConfig(Section):
    """One stage of a chained run (``[[stage]]``): a ``name``, optionally ``from_previous``, and any section of
    this page merged over the top level's (``[stage.trainer]``, ``[[stage.env]]`` …)."""

    name: str = Field(pattern=r"^[A-Za-z0-9._-]+$")
    """The stage's name: its folder under ``run.output_dir`` and the suffix of its ``run.name``."""

    from_previous: bool = False
    """Start from the previous stage's last weights (a whole HF folder) instead of ``model.path``; default: true
    for every stage but the first that sets no ``model.path``."""

    config: RlbusConfig
    """The stage's whole config (the top level with the stage's tables merged over it)."""


RlbusConfig.model_rebuild()
