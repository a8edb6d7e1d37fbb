"""The trainer's config sections: ``[trainer]`` (with its rl loss) and ``[ckpt]``.

Pure pydantic, no torch: ``--help`` and ``--dry-run`` import this without the trainer's weight.
"""

from typing import Annotated, Any, Literal

from pydantic import Field

from bus.config import Section


class DppoLossConfig(Section):
    type: Literal["dppo"] = "dppo"
    """Selects this loss: ``dppo``."""
    adv_tau: float = Field(1.0, ge=0)
    """Weight of the advantage term."""
    kl_tau: float = Field(1e-3, ge=0)
    """Weight of the (log-ratio)² term."""
    dppo_mask_low: float = Field(0.2, ge=0)
    """Mask a token when A ≤ 0 and π−μ < −this."""
    dppo_mask_high: float = Field(0.2, ge=0)
    """Mask a token when A > 0 and π−μ > this."""


class CispoLossConfig(Section):
    type: Literal["cispo"] = "cispo"
    """Selects this loss: ``cispo``."""
    eps_low: float = Field(0.2, ge=0)
    """Lower clip of the importance ratio: 1 − eps_low."""
    eps_high: float = Field(0.28, ge=0)
    """Upper clip of the importance ratio: 1 + eps_high."""
    kl_tau: float = Field(0.0, ge=0)
    """Weight of the (log-ratio)² term."""


class PpoLossConfig(Section):
    type: Literal["ppo"] = "ppo"
    """Selects this loss: ``ppo``."""
    clip_low: float = Field(0.2, ge=0)
    """Lower clip of the ratio: 1 − clip_low."""
    clip_high: float = Field(0.2, ge=0)
    """Upper clip of the ratio: 1 + clip_high."""
    kl_tau: float = Field(0.0, ge=0)
    """Weight of the (log-ratio)² term."""


class CustomLossConfig(Section):
    type: Literal["custom"] = "custom"
    """Selects this loss: ``custom``."""
    import_path: str
    """``package.module:function(inputs: LossInputs, **kwargs) -> LossTerms`` (see trainer.losses.dppo_loss)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to the function."""


LossConfig = Annotated[
    DppoLossConfig | CispoLossConfig | PpoLossConfig | CustomLossConfig, Field(discriminator="type")
]


class TrainerConfig(Section):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device to train on; auto = cuda when available."""

    nproc: int = Field(1, ge=1)
    """Data-parallel ranks (FSDP2; gloo on CPU)."""

    lr: float = Field(1e-4, ge=0)
    """Peak learning rate."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""

    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""

    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps."""

    schedule: Literal["constant", "cosine"] = "constant"
    """LR schedule after warmup."""

    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Cosine schedule floor as a fraction of lr."""

    max_grad_norm: float | None = Field(1.0, gt=0)
    """Gradient clipping norm; None = no clipping."""

    loss: LossConfig = Field(default_factory=DppoLossConfig)
    """Loss of rl-mode micro-batches (opd and sft have fixed losses)."""

    kl_penalty_coef: float = Field(0.0, ge=0)
    """ART's KL penalty against a reference policy: each rl token's advantage becomes
    ``A − coef · sg(logπ − logπ_ref)`` (the sampled-token estimate of KL(π‖π_ref)), which holds the policy near the
    reference; ``kl_ref`` reports the estimate per step. 0: off, no reference model is loaded. Separate from the
    loss's ``kl_tau``, which ties π to the inference policy μ."""

    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus of rl tokens: each rl loss token's loss gets ``− coef · H(π(·|context))`` (the whole
    vocabulary's entropy at the token's temperature), which holds exploration up against collapse. 0: off (the
    entropy is then only a metric, at no backward cost)."""

    kl_penalty_reference_step: int | None = Field(None, ge=1)
    """The reference of ``kl_penalty_coef``: None = the initial weights (``model.path``); a step = that step's
    weights in ``output_dir/weights`` (never pruned while they are the reference)."""

    logprob_chunk_size: int = Field(1024, ge=1)
    """Tokens per chunk when computing logprobs over the vocabulary (bounds logits memory)."""

    logits_keep_mb: int = Field(1024, ge=0)
    """MiB the logprob head may keep from a forward pass to its backward: when one ``[tokens, vocab]`` tensor of
    the pass fits (weight dtype; fp32 with ``entropy_coef``), the backward reuses the forward's softmax instead of
    recomputing every chunk's logits (a matmul and a softmax less per chunk). Larger passes recompute, holding only
    ``logprob_chunk_size × vocab``. 0: always recompute (least memory)."""

    forward_batch: int = Field(1, ge=1)
    """Micro-batches stacked into one forward/backward pass (rows padded to the longest; where samples share
    prompts, the micro-batches are cut into rows of their groups). Same update; on a GPU, larger values mean fewer,
    larger kernels (higher utilisation) at the cost of activation memory."""

    compile: bool = False
    """torch.compile each decoder layer and the chunked logprob head (GPU; the first step compiles)."""

    weight_transport: Literal["safetensors", "nccl"] = "safetensors"
    """How new weights reach inference servers: safetensors shards on disk, or an nccl/gloo broadcast."""

    nccl_host: str = "127.0.0.1"
    """Rendezvous host of the weight broadcast."""

    nccl_port: int = Field(29511, ge=1, le=65535)
    """Rendezvous port of the weight broadcast."""

    inference_world_size: int | None = Field(None, ge=1)
    """nccl/gloo transport: receivers of each broadcast, one per inference server process (the seed's
    ``weight_broadcast.inference_world_size``); None = one per server URL (``inference.base_urls``, or
    ``inference.servers`` local ones). With vLLM every worker process is a receiver: tensor parallel size ×
    servers."""

    max_shard_mb: int = Field(256, ge=1)
    """Maximum size of one safetensors shard in MiB. Shards are written and hashed in parallel: on an H200,
    Qwen3-0.6B's 1.11 GiB took 0.64 s to write in 256 MiB shards and 1.55 s as one shard."""

    keep_weights: int = Field(3, ge=1)
    """Weight directories kept (a directory still served is never deleted)."""

    lease_ttl_s: float = Field(10.0, gt=0)
    """One trainer trains at a time: its rank 0 holds a lease it renews from a thread every third of this. A second
    trainer waits as a standby and resumes from the newest checkpoint within this long of the first one dying (a
    clean stop hands over at once)."""

    progress_timeout_s: float = Field(1800.0, gt=0)
    """Longest the trainer's loop may go without progress (one step with its weights publication and checkpoint
    save, or one wait for the next batch) and still renew its lease. Past it the lease lapses, so a wedged trainer
    (a hung collective, stuck storage) hands the run to a standby within ``lease_ttl_s``; awake again, it publishes
    nothing once the standby has taken over. Set it above the longest step plus save."""

    keep_batches: int = Field(8, ge=0)
    """Trained ``batches:{s}`` streams kept in Redis: the trainer deletes ``batches:{s}`` once it is this many
    steps old and a checkpoint covers it (a restarted trainer never reads it again), so Redis does not grow with
    the run. 0: never delete. To replay a long run's batches later, set ``archive_batches``."""

    archive_batches: bool = False
    """Also write each trained step's micro-batches to ``output_dir/batches/step_{s}.msgpack``, which
    ``rlbus replay --from-archive`` reads back into a run's streams after Redis deleted them."""

    broadcast_timeout_s: float = Field(300.0, gt=0)
    """nccl/gloo transport: how long the trainer waits for every inference server to join a weight broadcast."""

    num_threads: int | None = Field(None, ge=1)
    """torch CPU threads; None = the share ``rlbus run`` assigns (or torch's default)."""


class CkptConfig(Section):
    interval: int | None = Field(None, ge=1)
    """Checkpoint every this many steps; None = never."""

    keep_last: int | None = Field(None, ge=1)
    """Keep this many recent checkpoints; None = all."""

    keep_interval: int | None = Field(None, ge=1)
    """Keep every checkpoint whose step is a multiple of this, permanently."""

    resume_step: int | None = Field(None, ge=-1)
    """Step to resume from; -1 = latest; None = start fresh."""

    skip_progress: bool = False
    """Resume the model and optimizer from the checkpoint, but not its progress: steps and data start from the
    beginning, as a new run from those weights (use a new run.name or an empty Redis)."""

    wait_for_weights_timeout: int | None = Field(None, ge=1)
    """When a weights event names a directory that is not complete yet (a resumed run whose trainer is still
    writing it, a shared file system that shows files late), an inference server waits up to this many seconds
    for it. None: skip the update at once and wait for the next one."""


