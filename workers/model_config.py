"""The sections of what is trained and what teaches it: ``[model]`` (with ``[model.lora]``) and ``[teacher]``."""

from typing import Literal

from pydantic import Field, model_validator

from bus.config import Section

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear projection of a Qwen/Llama decoder layer."""


class LoraConfig(Section):
    name: str | None = None
    """Adapter name (vLLM's ``lora_name``: a request for policy version ``s`` asks for model ``{name}-step{s}``);
    None = derived from rank and alpha (``r8-a16``)."""

    rank: int = Field(8, ge=1)
    """LoRA rank ``r``."""

    alpha: float = Field(16.0, ge=0)
    """LoRA alpha (the update is scaled by ``alpha / rank``)."""

    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training."""

    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1)
    """Module names (last component) that get an adapter."""

    @property
    def resolved_name(self) -> str:
        return self.name or f"r{self.rank}-a{self.alpha:g}"


class ModelConfig(Section):
    path: str = "outputs/models/tiny"
    """Local Hugging Face folder, or a hub id (``Qwen/Qwen3-0.6B``) read as transformers reads it: ``rlbus run``
    fetches it into the hub cache once (offline, it must be cached). A missing local folder gets the
    ``init_preset`` model."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype: auto = float32 on CPU, bfloat16 on GPU."""

    init_preset: Literal["tiny", "small"] | None = "tiny"
    """When ``path`` does not exist, ``rlbus run`` builds a random-init model of this preset there; None: fail
    instead."""

    lora: LoraConfig | None = None
    """Train a LoRA adapter instead of every weight (``[model.lora]``, or ``--model.lora.rank 8``): the trainer
    trains, checkpoints and publishes only the adapter; inference servers apply it over ``path``. None: full
    fine-tuning."""


class TeacherConfig(Section):
    path: str | None = None
    """Local Hugging Face folder of the teacher (opd: logprobs; sft: samples), which ``rlbus run`` serves when
    ``base_urls`` is empty; None: a teacher that runs elsewhere (``base_urls``)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype of the teacher."""

    base_urls: list[str] = Field(default_factory=list)
    """OpenAI-compatible servers hosting the teacher; empty: ``rlbus run`` starts one (from ``path``)."""

    api: Literal["completions", "chat"] = "completions"
    """How the teacher is asked: ``completions`` (token-id prompts on ``/v1/completions``: opd's prompt logprobs,
    sft samples with their token ids; vLLM or ``rlbus inference``) or ``chat`` (``/v1/chat/completions`` of any
    OpenAI-compatible endpoint, a hosted model included: sft only; no logprobs are asked, and each answer's text is
    tokenized with the student's tokenizer and chat template, the loss on the assistant tokens)."""

    model: str | None = None
    """Model name sent with every request (a hosted endpoint needs its own); None: the first of ``/v1/models``."""

    request_timeout_s: float = Field(300.0, gt=0)
    """Seconds one teacher request may take (the student's servers have ``inference.request_timeout_s``)."""

    max_retries: int = Field(3, ge=0)
    """Retries of a failed teacher request (connection errors, timeouts, 429, 5xx), with backoff."""

    api_key_var: str | None = None
    """Environment variable holding the teacher's API key (``Authorization: Bearer``); separate from
    ``inference.api_key_var``."""

    headers_from_env: dict[str, str] = Field(default_factory=dict)
    """Extra headers of teacher requests: header name → environment variable holding its value."""

    @model_validator(mode="after")
    def _somewhere(self) -> "TeacherConfig":
        if self.path is None and not self.base_urls:
            raise ValueError("[teacher] needs a path (rlbus run serves it) or base_urls (a teacher running elsewhere)")
        return self
