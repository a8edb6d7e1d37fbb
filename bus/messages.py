"""Every message on the bus, as pydantic models with ``to_fields()`` / ``from_fields()``.

A stream entry is a flat map: readable header fields first (``kind``, ``v`` and a few values a
person reads with ``redis-cli XRANGE``), then ``data``: the whole message as msgpack, arrays as
raw bytes. ``from_fields`` reads only ``kind``, ``v`` and ``data``; the header is for people.
"""

import functools
import time
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, computed_field, model_validator

from bus.arrays import (
    BoolArray,
    Float32Array,
    Int32Array,
    check_finite,
    check_lengths,
    check_token_ids,
    packb,
    to_wire,
    unpackb,
)
from bus.errors import DecodeError
from bus.resp import as_str

Mode = Literal["rl", "opd", "sft"]
"""Training mode of a sample or micro-batch: rl (policy gradient), opd (on-policy distillation), sft."""

MODES: tuple[Mode, ...] = typing.get_args(Mode)
"""Every mode, in the order a step's micro-batches are packed and its losses reported."""


class _Model(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid", validate_assignment=False)


class Message(_Model):
    """Base of every stream message."""

    KIND: ClassVar[str]
    V: ClassVar[int] = 1
    HEADER: ClassVar[tuple[str, ...]] = ()

    def to_fields(self) -> dict[str, bytes | str]:
        """The stream entry: readable header fields, then ``data`` (msgpack)."""
        fields: dict[str, bytes | str] = {"kind": self.KIND, "v": str(self.V)}
        for name in self.HEADER:
            value = getattr(self, name)
            if value is not None:
                fields[name] = _header_text(value)
        fields["data"] = packb(_plain(self))
        return fields

    @classmethod
    def from_fields(cls, fields: Mapping[Any, Any]) -> "Message":
        """Decode a stream entry of this kind; any problem raises DecodeError."""
        kind = _text(_get(fields, "kind"))
        if kind != cls.KIND:
            raise DecodeError(f"expected a {cls.KIND!r} entry, got kind {kind!r}")
        return _decode(cls, fields)


def decode(fields: Mapping[Any, Any]) -> Message:
    """Decode a stream entry of any known kind; any problem raises DecodeError."""
    kind = _text(_get(fields, "kind"))
    cls = MESSAGE_KINDS.get(kind)
    if cls is None:
        raise DecodeError(f"unknown message kind {kind!r}; known: {sorted(MESSAGE_KINDS)}")
    return _decode(cls, fields)


def _decode(cls: type[Message], fields: Mapping[Any, Any]) -> Message:
    raw_v = _text(_get(fields, "v"))
    try:
        version = int(raw_v)
    except ValueError as e:
        raise DecodeError(f"schema version v={raw_v!r} is not an integer") from e
    if version > cls.V:
        raise DecodeError(
            f"{cls.KIND} schema v={version} is newer than this reader's v={cls.V}; upgrade rlbus on this worker"
        )
    payload = unpackb(_get(fields, "data"))
    if not isinstance(payload, dict):
        raise DecodeError(f"{cls.KIND} data is a {type(payload).__name__}, expected a map")
    try:
        return cls.__pydantic_validator__.validate_python(payload)
    except (ValidationError, TypeError, ValueError, OverflowError) as e:  # whatever the bytes were
        raise DecodeError(f"{cls.KIND} v{version} does not validate: {e}") from e


def _get(fields: Mapping[Any, Any], name: str) -> Any:
    value = fields.get(name.encode())
    if value is None:
        value = fields.get(name)
    if value is None:
        raise DecodeError(f"entry has no {name!r} field (fields: {sorted(as_str(k) for k in fields)})")
    return value


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError as e:
            raise DecodeError(f"header value {value[:32]!r} is not UTF-8") from e
    return str(value)


def _header_text(value: Any) -> str:
    kind = type(value)
    if kind is str:
        return value
    if kind is float:
        return f"{value:.6g}"
    if kind is bool:
        return "1" if value else "0"
    return str(value)


def _holds_arrays_or_models(annotation: Any) -> bool:
    """True when a field annotation can hold numpy arrays or pydantic models (at any depth)."""
    if isinstance(annotation, type) and issubclass(annotation, (np.ndarray, BaseModel)):
        return True
    return any(_holds_arrays_or_models(arg) for arg in typing.get_args(annotation))


@functools.cache
def _convert_fields(cls: type[BaseModel]) -> tuple[str, ...]:
    """Fields of ``cls`` that :func:`_plain` must convert; the others go to msgpack as they are."""
    return tuple(name for name, f in cls.model_fields.items() if _holds_arrays_or_models(f.annotation))


def _plain(model: BaseModel) -> dict[str, Any]:
    """A message as dicts/lists/scalars/wire arrays for msgpack, without pydantic's dump machinery.

    Hot path: only the fields that can hold arrays or models are looked at.
    """
    out = dict(model.__dict__)
    for name in _convert_fields(type(model)):
        value = out[name]
        if type(value) is np.ndarray:
            out[name] = to_wire(value)
        elif isinstance(value, BaseModel):
            out[name] = _plain(value)
        elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
            out[name] = [_plain(v) for v in value]
    return out


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


class Task(Message):
    """One example to roll out as a group: feeder → ``tasks:{env}`` → rollout workers."""

    KIND: ClassVar[str] = "task"
    HEADER: ClassVar[tuple[str, ...]] = ("env", "example_id", "epoch", "mode", "group_size", "eval_step")

    task_id: str
    """Unique id of this task within the run (``{env}:{epoch}:{position}`` for training tasks)."""
    env: str
    """Name of the environment the example comes from."""
    example_index: int = Field(ge=0)
    """Index of the example in the environment's dataset."""
    example_id: str
    """Stable id of the example (the env's own id, or the index as text)."""
    epoch: int = Field(0, ge=0)
    """Pass over the dataset this task belongs to."""
    group_size: int = Field(ge=1)
    """Completions to sample for this example."""
    mode: Mode = "rl"
    """Training mode of the samples this task produces."""
    eval_step: int | None = None
    """For eval tasks: the policy version to evaluate; eval tasks are never dropped as stale."""
    issued_at: float = Field(default_factory=time.time)
    """Unix time the feeder issued the task."""


class Sample(_Model):
    """One completion of a group, with everything the trainer needs."""

    prompt_ids: Int32Array
    """Token ids of the prompt (the first turn's chat template output)."""
    completion_ids: Int32Array
    """Token ids after the prompt: model turns and, in multi-turn episodes, environment turns."""
    completion_logprobs: Float32Array
    """Inference logprob of each completion token (0 where loss_mask is 0)."""
    loss_mask: BoolArray
    """True for tokens the model sampled (trained on), False for environment/tool tokens."""
    teacher_logprobs: Float32Array | None = None
    """Teacher logprob of each completion token (opd mode)."""
    reward: float = Field(0.0, allow_inf_nan=False)
    """Weighted sum of the rubric's reward functions (finite)."""
    advantage: float = Field(0.0, allow_inf_nan=False)
    """Advantage, set by the filter; broadcast over the loss-masked tokens (finite)."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """Each reward function's value (and other per-sample numbers), by name."""
    policy_version_start: int = 0
    """Policy version served when generation of this sample started."""
    policy_version_end: int = 0
    """Policy version served when generation of this sample ended."""
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    """Sampling temperature the completion tokens were drawn at (the trainer divides logits by it)."""
    flags: dict[str, bool] = Field(default_factory=dict)
    """Filter annotations: filter type → flagged."""
    is_truncated: bool = False
    """True when generation stopped at the token limit rather than at EOS/done."""
    turns: int = 1
    """Model turns in the episode."""
    mode: Mode = "rl"
    """Training mode (which loss trains it); always its group's mode (taken from the group when unset)."""
    task_id: str = ""
    """The task this sample answers: always its group's (taken from the group when unset)."""
    index: int = Field(0, ge=0)
    """Its place in the group as the rollout made it, kept through filtering (set by the group when unset)."""

    @model_validator(mode="after")
    def _consistent(self) -> "Sample":
        n = len(self.completion_ids)
        check_lengths(n, "completion tokens", completion_logprobs=self.completion_logprobs, loss_mask=self.loss_mask,
                     teacher_logprobs=self.teacher_logprobs)
        check_finite(completion_logprobs=self.completion_logprobs, teacher_logprobs=self.teacher_logprobs)
        return self  # token ids against the vocabulary: the packer's check (it knows the vocabulary)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


class RolloutGroup(Message):
    """The scored completions of one task: rollout → ``rollouts:{env}`` → filter → ``filtered:{env}``."""

    KIND: ClassVar[str] = "rollout_group"
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
    timings: dict[str, float] = Field(default_factory=dict)
    """Seconds spent per phase (``wait_gate_s``, ``generate_s``, ``env_s``, ``score_s``, ``total_s``)."""
    created_at: float = Field(default_factory=time.time)
    """Unix time the group was published."""

    @model_validator(mode="after")
    def _samples_belong_to_the_group(self) -> "RolloutGroup":
        for position, sample in enumerate(self.samples):
            given = sample.model_fields_set
            if "mode" not in given:
                sample.mode = self.mode
            elif sample.mode != self.mode:
                raise ValueError(f"a sample has mode {sample.mode!r} in a group of mode {self.mode!r}")
            if "task_id" not in given:
                sample.task_id = self.task_id
            elif sample.task_id != self.task_id:
                raise ValueError(f"a sample of task {sample.task_id!r} in the group of task {self.task_id!r}")
            if "index" not in given:
                sample.index = position
        return self

    @computed_field  # type: ignore[prop-decorator]
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


class MicroBatch(Message):
    """One packed micro-batch of step ``s``: packer → ``batches:{s}`` → trainer.

    All per-token arrays are aligned with ``input_ids``: entry ``t`` describes token ``t``
    (its logprob is predicted from the logits at ``t - 1`` of the same sample).
    """

    KIND: ClassVar[str] = "micro_batch"
    HEADER: ClassVar[tuple[str, ...]] = ("step", "index", "count", "mode", "tokens", "samples")

    step: int = Field(ge=1)
    """Training step this micro-batch belongs to."""
    index: int = Field(ge=0)
    """Position of this micro-batch within the step."""
    count: int = Field(ge=1)
    """Number of micro-batches in the step."""
    mode: Mode
    """Loss to apply: rl, opd or sft."""
    input_ids: Int32Array
    """Packed token ids of every sample, concatenated."""
    position_ids: Int32Array
    """Position of each token within its own sample (restarts at 0 per sample)."""
    loss_mask: BoolArray
    """True on completion tokens that count in the loss."""
    advantages: Float32Array
    """Advantage per token (the sample's advantage on its loss tokens, 0 elsewhere)."""
    inference_logprobs: Float32Array
    """Inference logprob per token (0 off the loss mask)."""
    teacher_logprobs: Float32Array | None = None
    """Teacher logprob per token (opd), 0 off the loss mask."""
    temperatures: Float32Array
    """Sampling temperature per token (its sample's temperature)."""
    sample_lengths: Int32Array
    """Token count of each packed sample, in order (sums to len(input_ids))."""
    policy_versions: Int32Array
    """Start policy version of each packed sample (for the steps-off-policy metric)."""
    rewards: Float32Array
    """Reward of each packed sample (for metrics)."""
    task_ids: list[str] = Field(default_factory=list)
    """The task of each packed sample ("" for a padding sample; empty in batches recorded before these existed)."""
    sample_indices: Int32Array = Field(default_factory=lambda: np.zeros(0, np.int32))
    """Each packed sample's index in its group: with ``task_ids``, what was trained, auditable."""

    @property
    def tokens(self) -> int:
        return int(len(self.input_ids))

    @property
    def samples(self) -> int:
        return int(len(self.sample_lengths))

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @model_validator(mode="after")
    def _consistent(self) -> "MicroBatch":
        if self.index >= self.count:
            raise ValueError(f"index {self.index} is not below count {self.count}")
        n, k = len(self.input_ids), len(self.sample_lengths)
        check_lengths(n, "tokens", position_ids=self.position_ids, loss_mask=self.loss_mask,
                     advantages=self.advantages, inference_logprobs=self.inference_logprobs,
                     teacher_logprobs=self.teacher_logprobs, temperatures=self.temperatures)
        check_lengths(k, "samples", policy_versions=self.policy_versions, rewards=self.rewards,
                     task_ids=self.task_ids or None, sample_indices=self.sample_indices if len(self.sample_indices) else None)
        if int(self.sample_lengths.sum(dtype=np.int64)) != n or (k and int(self.sample_lengths.min()) < 1):
            raise ValueError(f"sample_lengths sum to {int(self.sample_lengths.sum(dtype=np.int64))} but the "
                             f"micro-batch has {n} tokens (each sample needs at least one)")
        check_token_ids(self.input_ids)
        check_finite(advantages=self.advantages, inference_logprobs=self.inference_logprobs,
                teacher_logprobs=self.teacher_logprobs, temperatures=self.temperatures, rewards=self.rewards)
        return self


class WeightFile(_Model):
    """One safetensors shard of a weight update."""

    name: str
    """File name inside the update's directory."""
    bytes: int = Field(ge=0)
    """File size in bytes."""
    sha256: str
    """Hex sha256 of the file."""


class WeightTensor(_Model):
    """One tensor of an nccl/gloo broadcast, in broadcast order."""

    name: str
    """Parameter name (Hugging Face state-dict key)."""
    dtype: str
    """torch dtype name, e.g. ``bfloat16``."""
    shape: list[int]
    """Tensor shape."""


class WeightUpdate(Message):
    """New weights after step ``step``: trainer → ``weights`` → every inference server."""

    KIND: ClassVar[str] = "weight_update"
    V: ClassVar[int] = 2
    HEADER: ClassVar[tuple[str, ...]] = ("step", "format", "dir", "adapter")

    step: int = Field(ge=0)
    """Training step that produced these weights."""
    format: Literal["safetensors", "nccl"]
    """``safetensors``: read the shards from ``dir``; ``nccl``: join the broadcast at host:port."""
    dir: str | None = None
    """Directory holding the shards (safetensors)."""
    files: list[WeightFile] = Field(default_factory=list)
    """The shard files with sizes and checksums (safetensors)."""
    host: str | None = None
    """Rendezvous host of the broadcast (nccl)."""
    port: int | None = None
    """Rendezvous port of the broadcast (nccl)."""
    world_size: int | None = None
    """Processes in the broadcast group, trainer rank 0 included (nccl)."""
    tensors: list[WeightTensor] = Field(default_factory=list)
    """Tensor manifest in broadcast order (nccl)."""
    adapter: str | None = None
    """LoRA: the adapter's name for this version (``{model.lora name}-step{step}``); ``dir`` then holds a PEFT
    adapter (adapter_config.json + adapter_model.safetensors) to apply over the base model, not whole weights (v2)."""
    created_at: float = Field(default_factory=time.time)
    """Unix time of publication."""

    def to_fields(self) -> dict[str, bytes | str]:
        """An update without an adapter is written as v1 (no ``adapter`` field), which older readers still take."""
        fields = super().to_fields()
        if self.adapter is None:
            fields["v"], fields["data"] = "1", packb({k: v for k, v in _plain(self).items() if k != "adapter"})
        return fields


class PolicyVersion(Message):
    """A policy version event: ``trained`` by the trainer, ``served`` by an inference server."""

    KIND: ClassVar[str] = "policy_version"
    HEADER: ClassVar[tuple[str, ...]] = ("role", "step", "server")

    role: Literal["trained", "served"]
    """Who reports: the trainer (weights of step written) or an inference server (now serving)."""
    step: int = Field(ge=0)
    """The policy version (training step)."""
    server: str = ""
    """Id of the inference server (``served`` only)."""
    at: float = Field(default_factory=time.time)
    """Unix time of the event."""


class Metric(Message):
    """Numbers a worker reports: → ``metrics`` → status display and metrics writers."""

    KIND: ClassVar[str] = "metric"
    HEADER: ClassVar[tuple[str, ...]] = ("source", "step")

    source: str
    """Reporting worker role (``trainer``, ``packer``, ``eval``, …)."""
    step: int | None = None
    """Training step the numbers belong to, if any."""
    values: dict[str, float]
    """Metric name → value (names like ``loss/rl``, ``reward/mean``)."""
    at: float = Field(default_factory=time.time)
    """Unix time of the report."""


class DeadLetter(Message):
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
    fields: dict[str, bytes] = Field(default_factory=dict)
    """The original entry, field by field."""
    at: float = Field(default_factory=time.time)
    """Unix time it was dead-lettered."""


MESSAGE_KINDS: dict[str, type[Message]] = {
    cls.KIND: cls for cls in (Task, RolloutGroup, MicroBatch, WeightUpdate, PolicyVersion, Metric, DeadLetter)
}
