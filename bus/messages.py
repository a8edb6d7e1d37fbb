"""Every message on the bus: its schema as a msgspec struct, one class per stream entry kind, and
:func:`decode` for an entry of any kind.

What a message is on the wire (header fields, ``data`` as msgpack, arrays as raw bytes) and how it is checked on
decode is :mod:`bus.codec`'s; each schema here adds its fields, its header, its version history and, in
``__post_init__``, the checks its fields need (bounds, lengths that must agree, finite values).
"""

import math
import time
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import msgspec
import numpy as np

from bus.arrays import (
    BOOL,
    FLOAT32,
    INT32,
    BoolArray,
    Float32Array,
    Int32Array,
    all_finite,
    as_array,
    check_finite,
    check_lengths,
    check_token_ids,
)
from bus.codec import (
    Message,
    Struct,
    check_at_least,
    check_finite_value,
    decode_as,
    entry_kind,
    triples_to_bytes,
)
from bus.errors import DecodeError

Mode = Literal["rl", "opd", "sft"]
"""Training mode of a sample or micro-batch: rl (policy gradient), opd (on-policy distillation), sft."""

MODES: tuple[Mode, ...] = typing.get_args(Mode)
"""Every mode, in the order a step's micro-batches are packed and its losses reported."""


def training_task_id(env: str, epoch: int, position: int) -> str:
    """The id of the training task at ``position`` of ``env``'s epoch ``epoch``: ``{env}:{epoch}:{position}``."""
    return f"{env}:{epoch}:{position}"


def task_position(task_id: str) -> tuple[str, int, int] | None:
    """``(env, epoch, position)`` of a training task id; None for any other id (eval tasks, foreign ones)."""
    env, _, rest = task_id.rpartition(":")
    env, _, epoch = env.rpartition(":")
    if not env or not epoch.isdigit() or not rest.isdigit():
        return None
    return env, int(epoch), int(rest)


class Task(Message, kw_only=True):
    """One example to roll out as a group: feeder → ``tasks:{env}`` → rollout workers."""

    KIND: ClassVar[str] = "task"
    HEADER: ClassVar[tuple[str, ...]] = ("env", "example_id", "epoch", "mode", "group_size", "eval_step")

    task_id: str
    """Unique id of this task within the run (``{env}:{epoch}:{position}`` for training tasks)."""
    env: str
    """Name of the environment the example comes from."""
    example_index: int
    """Index of the example in the environment's dataset (>= 0)."""
    example_id: str
    """Stable id of the example (the env's own id, or the index as text)."""
    epoch: int = 0
    """Pass over the dataset this task belongs to (>= 0)."""
    group_size: int
    """Completions to sample for this example (>= 1)."""
    mode: Mode = "rl"
    """Training mode of the samples this task produces."""
    eval_step: int | None = None
    """For eval tasks: the policy version to evaluate; eval tasks are never dropped as stale."""
    issued_at: float = msgspec.field(default_factory=time.time)
    """Unix time the feeder issued the task."""

    def __post_init__(self) -> None:
        check_at_least("example_index", self.example_index, 0)
        check_at_least("epoch", self.epoch, 0)
        check_at_least("group_size", self.group_size, 1)


class Sample(Struct, kw_only=True):
    """One completion of a group, with everything the trainer needs."""

    prompt_ids: Int32Array
    """Token ids of the prompt (the first turn's chat template output), int32."""
    completion_ids: Int32Array
    """Token ids after the prompt: model turns and, in multi-turn episodes, environment turns (int32)."""
    completion_logprobs: Float32Array
    """Inference logprob of each completion token (0 where loss_mask is 0), float32."""
    loss_mask: BoolArray
    """True for tokens the model sampled (trained on), False for environment/tool tokens (bool)."""
    teacher_logprobs: Float32Array | None = None
    """Teacher logprob of each completion token (opd), float32."""
    reward: float = 0.0
    """Weighted sum of the rubric's reward functions (finite)."""
    advantage: float = 0.0
    """Advantage, set by the filter; broadcast over the loss-masked tokens (finite)."""
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    """Each reward function's value (and other per-sample numbers), by name."""
    policy_version_start: int = 0
    """Policy version served when generation of this sample started."""
    policy_version_end: int = 0
    """Policy version served when generation of this sample ended."""
    temperature: float = 1.0
    """Sampling temperature the completion tokens were drawn at (the trainer divides logits by it; finite, >= 0)."""
    flags: dict[str, bool] = msgspec.field(default_factory=dict)
    """Filter annotations: filter type → flagged."""
    is_truncated: bool = False
    """True when generation stopped at the token limit rather than at EOS/done."""
    turns: int = 1
    """Model turns in the episode."""
    mode: Mode = "rl"
    """Training mode (which loss trains it); always its group's mode."""
    task_id: str = ""
    """The task this sample answers, always its group's. A sample joins its group while this is unset (""): it then
    takes the group's task id and mode, and its position in the group as ``index``."""
    index: int = 0
    """Its place in the group as the rollout made it, kept through filtering (>= 0)."""

    def __post_init__(self) -> None:
        # Hot path (every decoded sample): each check in one expression, its message only when it fails (decode of a
        # 1,024-token group 6.8 µs against 7.6 µs with the helpers called outright, interleaved in one process).
        self.prompt_ids = as_array(self.prompt_ids, INT32, "prompt_ids")
        self.completion_ids = completion = as_array(self.completion_ids, INT32, "completion_ids")
        self.completion_logprobs = logprobs = as_array(self.completion_logprobs, FLOAT32, "completion_logprobs")
        self.loss_mask = mask = as_array(self.loss_mask, BOOL, "loss_mask")
        teacher = self.teacher_logprobs
        if teacher is not None:
            self.teacher_logprobs = teacher = as_array(teacher, FLOAT32, "teacher_logprobs")
        n = len(completion)
        if len(logprobs) != n or len(mask) != n or (teacher is not None and len(teacher) != n):
            check_lengths(n, "completion tokens", completion_logprobs=logprobs, loss_mask=mask,
                          teacher_logprobs=teacher)
        if n and not (all_finite(logprobs) and (teacher is None or all_finite(teacher))):
            check_finite(completion_logprobs=logprobs, teacher_logprobs=teacher)
        if not (math.isfinite(self.reward) and math.isfinite(self.advantage) and 0 <= self.temperature < math.inf
                and self.index >= 0):
            check_finite_value("reward", self.reward)
            check_finite_value("advantage", self.advantage)
            check_finite_value("temperature", self.temperature)
            check_at_least("temperature", self.temperature, 0)
            check_at_least("index", self.index, 0)
        # token ids against the vocabulary: the packer's check (it knows the vocabulary)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


class RolloutGroup(Message, kw_only=True):
    """The scored completions of one task: rollout → ``rollouts:{env}`` → filter → ``filtered:{env}``."""

    KIND: ClassVar[str] = "rollout_group"
    V: ClassVar[int] = 2  # v2: arrays as bare bytes
    TRIPLES_BEFORE: ClassVar[int] = 2
    HEADER: ClassVar[tuple[str, ...]] = (
        "env", "example_id", "mode", "policy_version", "reward", "tokens", "samples_count", "eval_step",
    )

    task_id: str
    """Id of the task this group answers."""
    env: str
    """Environment name."""
    example_id: str
    """Stable id of the example."""
    example_index: int = 0
    """Index of the example in the env's dataset."""
    epoch: int = 0
    """Dataset pass of the task."""
    mode: Mode = "rl"
    """Training mode of every sample."""
    samples: list[Sample]
    """The completions."""
    eval_step: int | None = None
    """Set for eval groups (never trained on)."""
    timings: dict[str, float] = msgspec.field(default_factory=dict)
    """Seconds spent per phase (``wait_gate_s``, ``generate_s``, ``env_s``, ``score_s``, ``total_s``)."""
    created_at: float = msgspec.field(default_factory=time.time)
    """Unix time the group was published."""

    def __post_init__(self) -> None:
        for position, sample in enumerate(self.samples):
            if not sample.task_id:  # joins the group
                sample.task_id, sample.mode, sample.index = self.task_id, self.mode, position
            elif sample.task_id != self.task_id:
                raise ValueError(f"a sample of task {sample.task_id!r} in the group of task {self.task_id!r}")
            elif sample.mode != self.mode:
                raise ValueError(f"a sample has mode {sample.mode!r} in a group of mode {self.mode!r}")

    @property
    def policy_version(self) -> int:
        """Oldest start version of any sample: the version that gates staleness."""
        return min([s.policy_version_start for s in self.samples]) if self.samples else 0

    @property
    def reward(self) -> float:
        return sum([s.reward for s in self.samples]) / len(self.samples) if self.samples else 0.0

    @property
    def tokens(self) -> int:
        return sum([s.num_tokens for s in self.samples])

    @property
    def samples_count(self) -> int:
        return len(self.samples)

    @classmethod
    def _bytes_from_triples(cls, payload: dict[str, Any]) -> None:
        samples = payload.get("samples")
        for sample in samples if isinstance(samples, list) else ():
            triples_to_bytes(sample, _SAMPLE_ARRAYS)


class MicroBatch(Message, kw_only=True):
    """One packed micro-batch of step ``s``: packer → ``batches:{s}`` → trainer.

    All per-token arrays are aligned with ``input_ids``: entry ``t`` describes token ``t`` (its logprob is
    predicted from the logits at ``t - 1`` of the same sample). Samples of one group may share their prompt
    (``shared_prompt_lengths``): the first holds it, the others hold only their completions.
    """

    KIND: ClassVar[str] = "micro_batch"
    V: ClassVar[int] = 3  # v2: shared_prompt_lengths; v3: arrays as bare bytes
    TRIPLES_BEFORE: ClassVar[int] = 3
    HEADER: ClassVar[tuple[str, ...]] = ("step", "index", "count", "mode", "tokens", "samples")

    step: int
    """Training step this micro-batch belongs to (>= 1)."""
    index: int
    """Position of this micro-batch within the step (>= 0)."""
    count: int
    """Number of micro-batches in the step (>= 1)."""
    mode: Mode
    """Loss to apply: rl, opd or sft."""
    input_ids: Int32Array
    """Packed token ids of every sample, concatenated (int32)."""
    position_ids: Int32Array
    """Position of each token within its own sample (restarts at 0 per sample, goes on from the shared prompt's
    length in a sample that shares one; int32)."""
    loss_mask: BoolArray
    """True on completion tokens that count in the loss (bool)."""
    advantages: Float32Array
    """Advantage per token (the sample's advantage on its loss tokens, 0 elsewhere; float32)."""
    inference_logprobs: Float32Array
    """Inference logprob per token (0 off the loss mask; float32)."""
    teacher_logprobs: Float32Array | None = None
    """Teacher logprob per token (opd), 0 off the loss mask (float32)."""
    temperatures: Float32Array
    """Sampling temperature per token (its sample's temperature; float32)."""
    sample_lengths: Int32Array
    """Token count each packed sample holds, in order (sums to len(input_ids); int32)."""
    policy_versions: Int32Array
    """Start policy version of each packed sample (for the steps-off-policy metric; int32)."""
    rewards: Float32Array
    """Reward of each packed sample (for metrics; float32)."""
    task_ids: list[str] = msgspec.field(default_factory=list)
    """The task of each packed sample ("" for a padding sample; empty in batches recorded before these existed)."""
    sample_indices: Int32Array = msgspec.field(default_factory=lambda: np.zeros(0, INT32))
    """Each packed sample's index in its group (int32): with ``task_ids``, what was trained, auditable."""
    shared_prompt_lengths: Int32Array = msgspec.field(default_factory=lambda: np.zeros(0, INT32))
    """Per packed sample, how many leading tokens (its prompt) it reads from the nearest sample before it that
    shares none, which holds them (int32; empty or 0: the sample holds all its tokens). A sample sharing ``p``
    tokens holds only the tokens after them, at positions ``p, p + 1, …``; it attends to the holder's first ``p``
    tokens and its own, and its first token is predicted from the holder's token ``p − 1``."""

    @property
    def tokens(self) -> int:
        return int(len(self.input_ids))

    @property
    def samples(self) -> int:
        return int(len(self.sample_lengths))

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def __post_init__(self) -> None:
        check_at_least("step", self.step, 1)
        check_at_least("index", self.index, 0)
        check_at_least("count", self.count, 1)
        if self.index >= self.count:
            raise ValueError(f"index {self.index} is not below count {self.count}")
        for name, dtype in _MICRO_BATCH_ARRAYS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, as_array(value, dtype, name))
        n, k = len(self.input_ids), len(self.sample_lengths)
        check_lengths(n, "tokens", position_ids=self.position_ids, loss_mask=self.loss_mask,
                      advantages=self.advantages, inference_logprobs=self.inference_logprobs,
                      teacher_logprobs=self.teacher_logprobs, temperatures=self.temperatures)
        check_lengths(k, "samples", policy_versions=self.policy_versions, rewards=self.rewards,
                      task_ids=self.task_ids or None,
                      sample_indices=self.sample_indices if len(self.sample_indices) else None)
        if int(self.sample_lengths.sum(dtype=np.int64)) != n or (k and int(self.sample_lengths.min()) < 1):
            raise ValueError(f"sample_lengths sum to {int(self.sample_lengths.sum(dtype=np.int64))} but the "
                             f"micro-batch has {n} tokens (each sample needs at least one)")
        check_token_ids(self.input_ids)
        check_finite(advantages=self.advantages, inference_logprobs=self.inference_logprobs,
                     teacher_logprobs=self.teacher_logprobs, temperatures=self.temperatures, rewards=self.rewards)
        if len(self.shared_prompt_lengths):
            check_lengths(k, "samples", shared_prompt_lengths=self.shared_prompt_lengths)
            check_shared_prompts(self.sample_lengths, self.shared_prompt_lengths)

    @property
    def shares_prompts(self) -> bool:
        """Whether any sample reads its prompt from another (see ``shared_prompt_lengths``)."""
        return bool(len(self.shared_prompt_lengths)) and bool(self.shared_prompt_lengths.any())

    @classmethod
    def _bytes_from_triples(cls, payload: dict[str, Any]) -> None:
        triples_to_bytes(payload, _MICRO_BATCH_ARRAYS)


def check_shared_prompts(sample_lengths: np.ndarray, shared: np.ndarray) -> None:
    """Each shared prompt lies within the tokens its holder (the nearest earlier sample sharing none) holds."""
    holder = 0
    for i, p in enumerate(shared.tolist()):
        if p < 0 or (i == 0 and p):
            raise ValueError(f"sample {i} shares {p} prompt tokens (must be >= 0, and 0 for the first sample)")
        if p == 0:
            holder = i
        elif p > sample_lengths[holder]:
            raise ValueError(f"sample {i} shares {p} prompt tokens but its holder, sample {holder}, holds "
                             f"{int(sample_lengths[holder])}")


_SAMPLE_ARRAYS = (
    ("prompt_ids", INT32), ("completion_ids", INT32), ("completion_logprobs", FLOAT32), ("loss_mask", BOOL),
    ("teacher_logprobs", FLOAT32),
)
"""The array fields of a Sample, with their dtypes."""

_MICRO_BATCH_ARRAYS = (
    ("input_ids", INT32), ("position_ids", INT32), ("loss_mask", BOOL), ("advantages", FLOAT32),
    ("inference_logprobs", FLOAT32), ("teacher_logprobs", FLOAT32), ("temperatures", FLOAT32),
    ("sample_lengths", INT32), ("policy_versions", INT32), ("rewards", FLOAT32), ("sample_indices", INT32),
    ("shared_prompt_lengths", INT32),
)
"""MicroBatch's array fields and their dtypes."""


class WeightFile(Struct, kw_only=True):
    """One safetensors shard of a weight update."""

    name: str
    """File name inside the update's directory."""
    bytes: int
    """File size in bytes (>= 0)."""
    sha256: str
    """Hex sha256 of the file."""

    def __post_init__(self) -> None:
        check_at_least("bytes", self.bytes, 0)


class WeightTensor(Struct, kw_only=True):
    """One tensor of an nccl/gloo broadcast, in broadcast order."""

    name: str
    """Parameter name (Hugging Face state-dict key)."""
    dtype: str
    """torch dtype name, e.g. ``bfloat16``."""
    shape: list[int]
    """Tensor shape."""


class WeightUpdate(Message, kw_only=True):
    """New weights after step ``step``: trainer → ``weights`` → every inference server."""

    KIND: ClassVar[str] = "weight_update"
    V: ClassVar[int] = 2
    HEADER: ClassVar[tuple[str, ...]] = ("step", "format", "dir", "adapter")

    step: int
    """Training step that produced these weights (>= 0)."""
    format: Literal["safetensors", "nccl"]
    """``safetensors``: read the shards from ``dir``; ``nccl``: join the broadcast at host:port."""
    dir: str | None = None
    """Directory holding the shards (safetensors)."""
    files: list[WeightFile] = msgspec.field(default_factory=list)
    """The shard files with sizes and checksums (safetensors)."""
    host: str | None = None
    """Rendezvous host of the broadcast (nccl)."""
    port: int | None = None
    """Rendezvous port of the broadcast (nccl)."""
    world_size: int | None = None
    """Processes in the broadcast group, trainer rank 0 included (nccl)."""
    tensors: list[WeightTensor] = msgspec.field(default_factory=list)
    """Tensor manifest in broadcast order (nccl)."""
    adapter: str | None = None
    """LoRA: the adapter's name for this version (``{model.lora name}-step{step}``); ``dir`` then holds a PEFT
    adapter (adapter_config.json + adapter_model.safetensors) to apply over the base model, not whole weights (v2)."""
    created_at: float = msgspec.field(default_factory=time.time)
    """Unix time of publication."""

    def __post_init__(self) -> None:
        check_at_least("step", self.step, 0)

    def _written_as(self) -> tuple[int, Any]:
        """An update without an adapter is written as v1 (no ``adapter`` field), which older readers still take."""
        return (self.V, self) if self.adapter is not None else (1, self._without("adapter"))


class PolicyVersion(Message, kw_only=True):
    """A policy version event: ``trained`` by the trainer, ``served`` by an inference server."""

    KIND: ClassVar[str] = "policy_version"
    HEADER: ClassVar[tuple[str, ...]] = ("role", "step", "server")

    role: Literal["trained", "served"]
    """Who reports: the trainer (weights of step written) or an inference server (now serving)."""
    step: int
    """The policy version (training step, >= 0)."""
    server: str = ""
    """Id of the inference server (``served`` only)."""
    at: float = msgspec.field(default_factory=time.time)
    """Unix time of the event."""

    def __post_init__(self) -> None:
        check_at_least("step", self.step, 0)


class Metric(Message, kw_only=True):
    """Numbers a worker reports: → ``metrics`` → status display and metrics writers."""

    KIND: ClassVar[str] = "metric"
    HEADER: ClassVar[tuple[str, ...]] = ("source", "step")

    source: str
    """Reporting worker role (``trainer``, ``packer``, ``eval``, …)."""
    step: int | None = None
    """Training step the numbers belong to, if any."""
    values: dict[str, float]
    """Metric name → value (names like ``loss/rl``, ``reward/mean``)."""
    at: float = msgspec.field(default_factory=time.time)
    """Unix time of the report."""


class DeadLetter(Message, kw_only=True):
    """An entry that failed ``max_retries`` times or could not be decoded: → ``dead``."""

    KIND: ClassVar[str] = "dead_letter"
    HEADER: ClassVar[tuple[str, ...]] = ("stream", "entry_id", "reason", "worker", "deliveries")

    stream: str
    """Stream the entry came from."""
    entry_id: str
    """Its id in that stream."""
    reason: str
    """Why it was dead-lettered (the error)."""
    worker: str = ""
    """Consumer that gave up on it."""
    deliveries: int = 0
    """Times it had been delivered."""
    fields: dict[str, bytes] = msgspec.field(default_factory=dict)
    """The original entry, field by field."""
    at: float = msgspec.field(default_factory=time.time)
    """Unix time it was dead-lettered."""


MESSAGE_KINDS: dict[str, type[Message]] = {
    cls.KIND: cls for cls in (Task, RolloutGroup, MicroBatch, WeightUpdate, PolicyVersion, Metric, DeadLetter)
}


def decode(fields: Mapping[Any, Any]) -> Message:
    """Decode a stream entry of any known kind; any problem raises DecodeError."""
    kind = entry_kind(fields)
    cls = MESSAGE_KINDS.get(kind)
    if cls is None:
        raise DecodeError(f"unknown message kind {kind!r}; known: {sorted(MESSAGE_KINDS)}")
    return decode_as(cls, fields)
