"""The run's configuration: one TOML file, one pydantic model per section.

Every worker loads the whole file and reads the sections it needs. Unknown keys are errors;
validators check and explain, never rewrite other sections; derived values come from the
methods at the bottom of :class:`RlbusConfig`.
"""

import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, model_validator

from bus.config import LogConfig, RedisConfig, Section
from bus.messages import Mode
from trainer.config import CkptConfig, TrainerConfig


class RunConfig(Section):
    name: str = Field("default", pattern=r"^[A-Za-z0-9._-]+$")
    """Run name; every Redis key of the run starts with ``rlbus:{NAME}:``."""

    output_dir: Path = Path("outputs/default")
    """Directory for weights, checkpoints, metrics.jsonl, summary.json and report.png."""

    seed: int = 0
    """Seed for dataset shuffling, sampling and model init."""

    max_steps: int | None = Field(None, ge=1)
    """Training steps to run; None runs until stopped."""


class ModelConfig(Section):
    path: str = "outputs/models/tiny"
    """Local Hugging Face folder (or hub name where a hub is reachable). ``rlbus run`` creates the tiny preset here if missing."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype: auto = float32 on CPU, bfloat16 on GPU."""

    init_preset: Literal["tiny", "small"] | None = "tiny"
    """When ``path`` does not exist, ``rlbus run`` builds a random-init model of this preset there; None: fail instead."""


class TeacherConfig(Section):
    path: str
    """Local Hugging Face folder of the teacher (opd: logprobs; sft: samples)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype of the teacher."""

    base_urls: list[str] = Field(default_factory=list)
    """OpenAI-compatible servers hosting the teacher; empty: ``rlbus run`` starts one."""


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (the trainer divides logits by it)."""

    max_completion_tokens: int | None = Field(
        128, ge=1, validation_alias=AliasChoices("max_completion_tokens", "max_tokens")
    )
    """Maximum tokens per model turn. None: until EOS or the context limit."""

    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold (1.0 = off). Training should keep it off: logprobs are of the full distribution."""

    top_k: int = Field(-1, ge=-1)
    """Top-k sampling; -1 = off."""

    min_p: float = Field(0.0, ge=0, le=1)
    """Min-p sampling threshold; 0 = off."""

    stop: list[str] = Field(default_factory=list)
    """Stop strings ending a model turn."""

    extra_body: dict[str, Any] = Field(default_factory=dict)
    """Extra fields sent with every completion request."""

    @model_validator(mode="before")
    @classmethod
    def _deprecate_max_tokens(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_tokens" in data and "max_completion_tokens" not in data:
            warnings.warn("'max_tokens' is deprecated, use 'max_completion_tokens'", FutureWarning, stacklevel=2)
        return data


class EvalSamplingConfig(SamplingConfig):
    temperature: float = Field(0.0, ge=0)
    """Eval sampling temperature (0 = greedy)."""


class EnvConfig(Section):
    id: str
    """Built-in env name (``reverse_text``, ``echo_chars``, ``guess_number``) or import path ``package.module:factory``."""

    name: str | None = None
    """Display name in keys, logs and metrics; defaults to the id. Unique per run; ``all`` is reserved."""

    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the env factory."""

    ratio: float | None = Field(None, gt=0)
    """Relative sampling weight; set on all train envs or on none (uniform over examples)."""

    group_size: int = Field(8, ge=1, validation_alias=AliasChoices("group_size", "rollouts_per_example"))
    """Completions sampled per example (the GRPO group)."""

    mode: Mode = "rl"
    """Training mode of this env's samples: rl, opd (needs [teacher]) or sft (needs [teacher])."""

    address: str | None = None
    """ZeroMQ address of an external env server (``tcp://host:5555``); None: the rollout worker spawns one."""

    max_retries: int = Field(3, ge=0)
    """Times a failed rollout of this env is retried before it is dead-lettered."""

    max_turns: int = Field(8, ge=1)
    """Model turns per episode in multi-turn envs."""

    sampling: SamplingConfig | None = None
    """Per-env sampling; None uses [sampling]."""

    @property
    def resolved_name(self) -> str:
        return self.name or self.id.rsplit(":", 1)[-1]

    @model_validator(mode="after")
    def _check_name(self) -> "EnvConfig":
        if self.resolved_name == "all":
            raise ValueError('env name "all" is reserved for aggregate metrics; set name = "..." to something else')
        if any(c in self.resolved_name for c in "{}: *?[]"):
            raise ValueError(f"env name {self.resolved_name!r} cannot be used in a Redis key; set name = ...")
        return self


class EvalEnvConfig(EnvConfig):
    num_examples: int = -1
    """Examples to evaluate; -1 = all."""

    interval: int | None = Field(None, ge=1)
    """Evaluate every this many steps; None uses [eval].interval."""

    group_size: int = Field(1, ge=1, validation_alias=AliasChoices("group_size", "rollouts_per_example"))
    """Samples per example; pass@k for binary rewards uses k ≤ group_size."""

    sampling: EvalSamplingConfig | None = None
    """Per-env eval sampling; None uses [eval.sampling]."""


class EvalConfig(Section):
    env: list[EvalEnvConfig] = Field(default_factory=list)
    """Eval environments (``[[eval.env]]``); empty = no eval."""

    interval: int = Field(10, ge=1)
    """Default steps between evals."""

    sampling: EvalSamplingConfig = Field(default_factory=EvalSamplingConfig)
    """Eval sampling, separate from training sampling."""

    skip_first_step: bool = False
    """Skip the eval of the initial policy (step 0)."""

    timeout_s: float | None = Field(600.0, gt=0)
    """An eval not complete this many seconds after it was issued finishes with the groups it has
    (``eval/{env}/groups_missing`` counts the rest, ``eval/{env}/timed_out`` = 1), so a lost eval task never pins
    ``eval:hold`` and the run; None = wait forever. Dead-lettered eval tasks count as done (missing) at once."""


class FeederConfig(Section):
    max_inflight_rollouts: int | None = Field(None, ge=1)
    """Rollouts (samples) issued by the feeder and not yet consumed by the packer (queued tasks, running groups,
    groups waiting in rollouts:/filtered: streams and held by the packer), across the run; None =
    batch_size × oversampling_factor + (largest group_size − 1), so a full batch can always form. When the cap is
    reached and every in-flight sample is held by the packer, it packs a smaller step rather than wait."""

    oversampling_factor: float | None = Field(None, gt=0)
    """With batch_size: max_inflight_rollouts = batch_size × this + (largest group_size − 1) (default 1.0)."""

    shuffle: bool = True
    """Shuffle each epoch's example order (seeded by run.seed and the epoch)."""

    max_epochs: int | None = Field(None, ge=1)
    """Stop issuing after this many passes over the data; None = forever."""


class RolloutConfig(Section):
    workers: int = Field(1, ge=1)
    """Rollout worker processes ``rlbus run`` starts."""

    max_concurrent_groups: int = Field(4, ge=1)
    """Groups one worker rolls out at once."""

    tasks_per_minute: int | None = Field(None, ge=1)
    """Rate limit per worker; None = unlimited."""

    env_timeout_s: float = Field(30.0, gt=0)
    """Timeout of one env-server RPC."""

    retry_delay_s: float = Field(1.0, ge=0)
    """Delay before a failed rollout is retried."""


class FilterSpec(Section):
    enforce: bool = False
    """True: drop flagged samples; False: annotate and count only."""


class GibberishFilterConfig(FilterSpec):
    type: Literal["gibberish"] = "gibberish"
    token_id_threshold: int = 100_000
    """Token ids above this are candidates (BPE ids are sorted by merge order)."""
    logprob_offset: float = 2.0
    """Flag when logprob < -ln(vocab_size) - logprob_offset."""


class RepetitionFilterConfig(FilterSpec):
    type: Literal["repetition"] = "repetition"
    window: int = Field(3_000, ge=1)
    """Consecutive high-probability tokens that flag a sample."""
    prob_threshold: float = Field(0.99, gt=0, le=1)
    """A token sampled with probability above this counts toward the window."""


class ZeroAdvantageFilterConfig(FilterSpec):
    type: Literal["zero_advantage"] = "zero_advantage"


SampleFilterConfig = Annotated[
    GibberishFilterConfig | RepetitionFilterConfig | ZeroAdvantageFilterConfig, Field(discriminator="type")
]


def _unique_filter_types(filters: list[Any], slot: str) -> None:
    types = [f.type for f in filters]
    if len(types) != len(set(types)):
        raise ValueError(f"duplicate filter types in {slot}: {types}; each type may appear once per slot")


class AdvantageConfig(Section):
    std_normalize: bool = False
    """Divide the centred rewards by the group's std (Dr. GRPO leaves this off)."""

    length_penalty: float = Field(0.0, ge=0)
    """Subtracted per completion token (× tokens / max_completion_tokens) from the reward before centring."""


class FilterConfig(Section):
    workers: int = Field(1, ge=1)
    """Filter worker processes ``rlbus run`` starts."""

    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    """How rewards become advantages."""

    pre_batch_filters: list[SampleFilterConfig] = Field(
        default_factory=lambda: [
            GibberishFilterConfig(enforce=False),
            RepetitionFilterConfig(enforce=False),
            ZeroAdvantageFilterConfig(enforce=False),
        ]
    )
    """Filters applied by the filter worker, before a sample takes a batch slot."""

    @model_validator(mode="after")
    def _unique(self) -> "FilterConfig":
        _unique_filter_types(self.pre_batch_filters, "filter.pre_batch_filters")
        return self


class PackerConfig(Section):
    lease_ttl_s: float = Field(5.0, gt=0)
    """One packer builds steps at a time: it holds a lease it renews every third of this. Another packer waits
    as a standby and takes over, with the first one's pending groups, within this long of the first one dying."""

    batch_size: int | None = Field(None, ge=1)
    """Samples per step; set this or token_batch_size (neither: 128)."""

    token_batch_size: int | None = Field(None, ge=1)
    """Tokens per step (overflow carries into the next step); needs feeder.max_inflight_rollouts."""

    seq_len: int = Field(2048, ge=8)
    """Micro-batch capacity in tokens; longer samples are truncated (and counted)."""

    max_off_policy_steps: int = Field(8, ge=1)
    """Policy versions a step may lag behind: step s trains only on groups started at version ≥ s − this, and a
    rollout starts only while served ≥ (trained + 1 + prefetch_steps) − this. Must exceed prefetch_steps;
    prefetch_steps + 1 is as on-policy as prefetching allows (1 with no prefetch: step s uses policy s − 1
    only); higher values trade off-policy noise for throughput."""

    prefetch_steps: int = Field(1, ge=0)
    """Build step s only once s ≤ trained + 1 + prefetch_steps (the trainer never waits on packing)."""

    collapse_after: int | None = Field(None, ge=1)
    """Stop the run after this many consecutive zero-variance groups; None = 100 × the smallest batch in groups."""

    post_batch_filters: list[SampleFilterConfig] = Field(
        default_factory=lambda: [GibberishFilterConfig(), RepetitionFilterConfig(), ZeroAdvantageFilterConfig()]
    )
    """Filters applied by the packer to an assembled batch."""

    @model_validator(mode="after")
    def _check(self) -> "PackerConfig":
        if self.batch_size is not None and self.token_batch_size is not None:
            raise ValueError("set exactly one of packer.batch_size or packer.token_batch_size, not both")
        _unique_filter_types(self.post_batch_filters, "packer.post_batch_filters")
        if self.max_off_policy_steps <= self.prefetch_steps:
            raise ValueError(
                f"packer.max_off_policy_steps={self.max_off_policy_steps} must exceed packer.prefetch_steps="
                f"{self.prefetch_steps}: step trained + 1 + {self.prefetch_steps} is built from groups of policy ≤ trained,"
                f" so every group would be dropped as stale; raise max_off_policy_steps or lower prefetch_steps"
            )
        return self


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

    num_threads: int | None = Field(None, ge=1)
    """torch CPU threads of the server; None = the share ``rlbus run`` assigns."""

    request_timeout_s: float = Field(300.0, gt=0)
    """Client timeout of one request."""

    max_retries: int = Field(3, ge=0)
    """Client retries (with exponential backoff) of a failed request."""

    api_key_var: str | None = None
    """Environment variable holding the API key sent as a bearer token."""

    headers_from_env: dict[str, str] = Field(default_factory=dict)
    """HTTP header name → environment variable holding its value."""

    vllm_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for the vLLM server."""


class WandbConfig(Section):
    project: str
    """W&B project."""

    name: str | None = None
    """W&B run name; None = run.name."""

    mode: Literal["online", "offline"] = "offline"
    """offline writes locally (``wandb sync`` later)."""


class RlbusConfig(Section):
    """The whole run configuration (one TOML file)."""

    run: RunConfig = Field(default_factory=RunConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    teacher: TeacherConfig | None = None
    env: list[EnvConfig] = Field(default_factory=list)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    feeder: FeederConfig = Field(default_factory=FeederConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    filter: FilterConfig = Field(default_factory=FilterConfig)
    packer: PackerConfig = Field(default_factory=PackerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    ckpt: CkptConfig = Field(default_factory=CkptConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    wandb: WandbConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> "RlbusConfig":
        names = [e.resolved_name for e in self.env]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate env names {dupes}; give each [[env]] a unique name")
        ratios = [e.ratio for e in self.env]
        if any(r is None for r in ratios) and any(r is not None for r in ratios):
            raise ValueError("set ratio on every [[env]] or on none (got a mix of set and unset ratios)")
        for env in self.env:
            if env.mode in ("opd", "sft") and self.teacher is None:
                raise ValueError(f"env {env.resolved_name!r} has mode={env.mode!r}, which needs a [teacher] section")
        batch = self.packer.batch_size
        if batch is not None:
            for env in self.env:
                if batch % env.group_size:
                    raise ValueError(
                        f"packer.batch_size={batch} is not divisible by group_size={env.group_size} of env "
                        f"{env.resolved_name!r}; make batch_size a multiple of every group_size"
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
        batch = self.batch_size() or 0
        factor = self.feeder.oversampling_factor if self.feeder.oversampling_factor is not None else 1.0
        largest = max((e.group_size for e in self.env), default=1)
        return max(largest, int(batch * factor) + largest - 1)

    def inference_urls(self) -> list[str]:
        """Base URLs of the policy's inference servers: ``inference.base_urls``, else the ``servers`` local ports."""
        cfg = self.inference
        return cfg.base_urls or [f"http://{cfg.host}:{cfg.port + i}/v1" for i in range(cfg.servers)]

    def env_sampling(self, env: EnvConfig) -> SamplingConfig:
        """Sampling of one env: its own section, else [sampling]."""
        return env.sampling if env.sampling is not None else self.sampling

    def eval_sampling(self, env: EvalEnvConfig) -> EvalSamplingConfig:
        """Eval sampling of one eval env: its own section, else [eval.sampling]."""
        return env.sampling if env.sampling is not None else self.eval.sampling

    def eval_interval(self, env: EvalEnvConfig) -> int:
        """Steps between evals of one eval env."""
        return env.interval if env.interval is not None else self.eval.interval

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
