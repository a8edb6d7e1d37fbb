"""The sections of how rollouts become batches: ``[feeder]``, ``[filter]`` (sample filters, advantages) and
``[packer]``."""

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from bus.config import Section


class FeederConfig(Section):
    max_inflight_rollouts: int | None = Field(None, ge=1)
    """Rollouts (samples) issued by the feeder and not yet consumed by the packer (queued tasks, running groups,
    groups waiting in rollouts:/filtered: streams and held by the packer), across the run; None =
    batch_size (packer.max_batch_size when set) × oversampling_factor + (largest group_size − 1), so a full batch
    can always form. When the cap is
    reached and every in-flight sample is held by the packer, it packs a smaller step rather than wait."""

    oversampling_factor: float | None = Field(None, gt=0)
    """With batch_size: max_inflight_rollouts = batch_size × this + (largest group_size − 1) (default 1.0)."""

    shuffle: bool = True
    """Shuffle each epoch's example order (seeded by run.seed and the epoch)."""

    max_epochs: int | None = Field(None, ge=1)
    """Stop issuing after this many passes over the data; None = forever."""


class FilterSpec(Section):
    enforce: bool = False
    """True: drop flagged samples; False: annotate and count only."""


class GibberishFilterConfig(FilterSpec):
    type: Literal["gibberish"] = "gibberish"
    """Selects this filter: ``gibberish``."""
    token_id_threshold: int = 100_000
    """Token ids above this are candidates (BPE ids are sorted by merge order)."""
    logprob_offset: float = 2.0
    """Flag when logprob < -ln(vocab_size) - logprob_offset."""


class RepetitionFilterConfig(FilterSpec):
    type: Literal["repetition"] = "repetition"
    """Selects this filter: ``repetition``."""
    window: int = Field(3_000, ge=1)
    """Consecutive high-probability tokens that flag a sample."""
    prob_threshold: float = Field(0.99, gt=0, le=1)
    """A token sampled with probability above this counts toward the window."""


class ZeroAdvantageFilterConfig(FilterSpec):
    type: Literal["zero_advantage"] = "zero_advantage"
    """Selects this filter: ``zero_advantage``."""
    enforce: bool = True
    """True (as in prime-rl and ART): drop rl samples whose advantage is 0 (every sample of their group scored the
    same), so they take no place in the batch nor in the loss normaliser; the pre-batch slot lists it monitor-only."""


class TruncatedFilterConfig(FilterSpec):
    type: Literal["truncated"] = "truncated"
    """Selects this filter: ``truncated``."""
    enforce: bool = True
    """True (DAPO's overlong filtering, TRL's ``mask_truncated_completions``): drop samples that stopped at the token
    limit rather than at the end of their turn, so RL never reinforces an answer that does not end (its reward still
    counts in its group's baseline)."""


SampleFilterConfig = Annotated[
    GibberishFilterConfig | RepetitionFilterConfig | ZeroAdvantageFilterConfig | TruncatedFilterConfig,
    Field(discriminator="type"),
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

    max_batch_size: int | None = Field(None, ge=1)
    """ART's dynamic batch: a step waits for ``batch_size`` samples (its minimum), then also takes whatever whole
    groups are already queued, up to this many samples. None: every step takes ``batch_size``."""

    token_batch_size: int | None = Field(None, ge=1)
    """Tokens per step (overflow carries into the next step); needs feeder.max_inflight_rollouts."""

    seq_len: int = Field(2048, ge=8)
    """Micro-batch capacity in tokens; longer samples are truncated (and counted)."""

    share_prompts: bool = True
    """Pack the samples of a group that have the same prompt with one copy of it (the prompt, then each
    completion, each attending to the prompt and itself): the same loss and gradients, and the trainer runs the
    prompt once a group instead of once a sample. False: every sample holds its own prompt."""

    max_off_policy_steps: int = Field(8, ge=0)
    """How many policy versions a group may be behind the policy its step trains (as in prime-rl and ART): step s
    trains policy s − 1, so it keeps groups started at version ≥ s − 1 − this, and drops older ones as stale.
    0 = strictly on-policy (every group of step s was sampled from policy s − 1; prefetching is then off).
    Higher values trade off-policy noise for throughput."""

    prefetch_steps: int = Field(1, ge=0)
    """Build step s once s ≤ trained + 1 + this, so the trainer never waits on packing. Capped at
    max_off_policy_steps (a prefetched step is at least that many versions behind), so prefetching never changes
    what max_off_policy_steps allows."""

    @property
    def prefetch(self) -> int:
        """The prefetch in effect: ``prefetch_steps`` capped at ``max_off_policy_steps``."""
        return min(self.prefetch_steps, self.max_off_policy_steps)

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
        if self.max_batch_size is not None:
            if self.token_batch_size is not None:
                raise ValueError("packer.max_batch_size works with packer.batch_size only; remove it")
            if self.max_batch_size < (self.batch_size or 128):
                raise ValueError(f"packer.max_batch_size={self.max_batch_size} is below packer.batch_size="
                                 f"{self.batch_size or 128} (the minimum); raise it or unset it")
        return self
