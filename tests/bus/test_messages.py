"""Every message type survives the wire (as Redis hands it back: bytes keys and values); bad entries raise
DecodeError."""

import itertools
import math

import hypothesis.extra.numpy as hnp
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio.connection import Connection

from bus.arrays import pack_message, packb, unpackb
from bus.errors import DecodeError
from bus.messages import (
    MESSAGE_KINDS,
    DeadLetter,
    Metric,
    MicroBatch,
    PolicyVersion,
    RolloutGroup,
    Sample,
    Task,
    WeightFile,
    WeightTensor,
    WeightUpdate,
    decode,
)
from bus.resp import fast_packing

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

text = st.text(max_size=20)
names = st.text(alphabet="abcdefghij_0123456789", min_size=1, max_size=12)
finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
lengths = st.integers(0, 300)


def int32s(size):
    return hnp.arrays(np.int32, size)


def token_ids(size):
    return hnp.arrays(np.int32, size, elements=st.integers(0, 2**31 - 1))


def float32s(size):
    """Finite float32 arrays: a message that carries NaN or inf does not validate (tested below)."""
    return hnp.arrays(np.float32, size, elements=st.floats(width=32, allow_nan=False, allow_infinity=False))


def bools(size):
    return hnp.arrays(np.bool_, size)


@st.composite
def samples(draw):
    n = draw(lengths)
    return Sample(
        prompt_ids=draw(token_ids(draw(lengths))),
        completion_ids=draw(token_ids(n)),
        completion_logprobs=draw(float32s(n)),
        loss_mask=draw(bools(n)),
        teacher_logprobs=draw(st.none() | float32s(n)),
        reward=draw(finite),
        advantage=draw(finite),
        metrics=draw(st.dictionaries(names, finite, max_size=3)),
        policy_version_start=draw(st.integers(0, 1000)),
        policy_version_end=draw(st.integers(0, 1000)),
        temperature=draw(st.floats(0, 2)),
        flags=draw(st.dictionaries(names, st.booleans(), max_size=3)),
        is_truncated=draw(st.booleans()),
        turns=draw(st.integers(1, 8)),
    )


tasks = st.builds(
    Task,
    task_id=text,
    env=names,
    example_index=st.integers(0, 10**9),
    example_id=text,
    epoch=st.integers(0, 100),
    group_size=st.integers(1, 64),
    mode=st.sampled_from(["rl", "opd", "sft"]),
    eval_step=st.none() | st.integers(0, 100),
)
groups = st.builds(
    RolloutGroup,
    task_id=text,
    env=names,
    example_id=text,
    samples=st.lists(samples(), max_size=4),
    eval_step=st.none() | st.integers(0, 100),
    timings=st.dictionaries(names, finite, max_size=3),
)


@st.composite
def micro_batches(draw):
    sizes = draw(st.lists(st.integers(1, 60), max_size=8))
    n, k = sum(sizes), len(sizes)
    return MicroBatch(
        step=draw(st.integers(1, 10**6)),
        index=draw(st.integers(0, 7)),
        count=8,
        mode=draw(st.sampled_from(["rl", "opd", "sft"])),
        input_ids=draw(token_ids(n)),
        position_ids=draw(int32s(n)),
        loss_mask=draw(bools(n)),
        advantages=draw(float32s(n)),
        inference_logprobs=draw(float32s(n)),
        teacher_logprobs=draw(st.none() | float32s(n)),
        temperatures=draw(float32s(n)),
        sample_lengths=np.array(sizes, np.int32),
        task_ids=draw(st.lists(text, min_size=k, max_size=k)),
        sample_indices=draw(hnp.arrays(np.int32, k, elements=st.integers(0, 1000))),
        policy_versions=draw(int32s(k)),
        rewards=draw(float32s(k)),
    )


weight_updates = st.builds(
    WeightUpdate,
    step=st.integers(0, 10**6),
    format=st.sampled_from(["safetensors", "nccl"]),
    dir=st.none() | text,
    files=st.lists(st.builds(WeightFile, name=text, bytes=st.integers(0, 2**40), sha256=text), max_size=3),
    host=st.none() | text,
    port=st.none() | st.integers(1, 65535),
    world_size=st.none() | st.integers(1, 64),
    tensors=st.lists(
        st.builds(WeightTensor, name=text, dtype=names, shape=st.lists(st.integers(0, 4096), max_size=3)), max_size=3
    ),
)
policies = st.builds(
    PolicyVersion, role=st.sampled_from(["trained", "served"]), step=st.integers(0, 10**6), server=text
)
metrics = st.builds(
    Metric, source=names, step=st.none() | st.integers(0, 10**6), values=st.dictionaries(text, finite, max_size=5)
)
dead_letters = st.builds(
    DeadLetter,
    stream=text,
    entry_id=text,
    reason=text,
    worker=text,
    deliveries=st.integers(0, 100),
    fields=st.dictionaries(text, st.binary(max_size=64), max_size=4),
)


def as_redis(fields: dict) -> dict[bytes, bytes]:
    """What XREADGROUP returns for an entry written with these fields."""
    return {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}


def assert_same(a, b) -> None:
    if isinstance(a, msgspec.Struct):
        assert type(a) is type(b)
        for key in a.__struct_fields__:
            assert_same(getattr(a, key), getattr(b, key))
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


def round_trip(message):
    fields = message.to_fields()
    assert fields["kind"] == message.KIND and 1 <= int(fields["v"]) <= message.V
    sent = b"".join(fast_packing(Connection)().pack_command("XADD", "s", "*", message.entry_args()))
    assert sent == b"".join(Connection().pack_command("XADD", "s", "*", *itertools.chain(*fields.items())))
    back = decode(as_redis(fields))
    assert_same(message, back)
    assert_same(message, type(message).from_fields(as_redis(fields)))
    return fields


@pytest.mark.parametrize(
    "strategy", [tasks, groups, micro_batches(), weight_updates, policies, metrics, dead_letters], ids=lambda s: ""
)
def test_every_message_type_round_trips(strategy):
    @SETTINGS
    @given(strategy)
    def check(message):
        round_trip(message)

    check()


def test_every_kind_is_covered():
    assert set(MESSAGE_KINDS) == {
        "task", "rollout_group", "micro_batch", "weight_update", "policy_version", "metric", "dead_letter",
    }


def test_large_arrays_round_trip_as_read_only_views():
    rng = np.random.default_rng(0)
    n = 200_000
    sample = Sample(
        prompt_ids=rng.integers(0, 2**31 - 1, 4096, dtype=np.int32),
        completion_ids=rng.integers(0, 2**31 - 1, n, dtype=np.int32),
        completion_logprobs=-rng.random(n, dtype=np.float32),
        loss_mask=rng.random(n) > 0.5,
    )
    group = RolloutGroup(task_id="t", env="e", example_id="0", samples=[sample])
    fields = round_trip(group)
    assert len(fields["data"]) > n * 9
    back = decode(as_redis(fields)).samples[0].completion_ids
    assert not back.flags.writeable


def test_empty_arrays_round_trip():
    empty = np.zeros(0, dtype=np.int32)
    batch = MicroBatch(
        step=1, index=0, count=1, mode="sft", input_ids=empty, position_ids=empty, loss_mask=np.zeros(0, bool),
        advantages=np.zeros(0, np.float32), inference_logprobs=np.zeros(0, np.float32),
        temperatures=np.zeros(0, np.float32), sample_lengths=empty, policy_versions=empty,
        rewards=np.zeros(0, np.float32),
    )
    round_trip(batch)


def test_headers_are_readable():
    sample = Sample(prompt_ids=[1, 2], completion_ids=[3], completion_logprobs=[-0.5], loss_mask=[True], reward=0.5)
    group = RolloutGroup(task_id="e:0:1", env="e", example_id="7", samples=[sample, sample])
    fields = group.to_fields()
    assert fields["env"] == "e" and fields["example_id"] == "7"
    assert fields["reward"] == "0.5" and fields["tokens"] == "6" and fields["samples_count"] == "2"
    assert "eval_step" not in fields


def task_fields():
    return as_redis(Task(task_id="e:0:0", env="e", example_index=0, example_id="0", group_size=2).to_fields())


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda f: f.update({b"v": b"99"}), "newer than this reader"),
        (lambda f: f.update({b"v": b"one"}), "not an integer"),
        (lambda f: f.pop(b"data"), "no 'data' field"),
        (lambda f: f.pop(b"kind"), "no 'kind' field"),
        (lambda f: f.update({b"kind": b"nope"}), "unknown message kind"),
        (lambda f: f.update({b"data": b"\xc1\xff garbage"}), "not valid msgpack"),
        (lambda f: f.update({b"data": b"\x93\x01\x02\x03"}), "expected a map"),
        (lambda f: f.update({b"data": b"\x80"}), "does not validate"),
        (lambda f: f.update({b"kind": b"\xff\xfe"}), "not UTF-8"),
    ],
)
def test_bad_entries_raise_decode_error(change, words):
    fields = task_fields()
    change(fields)
    with pytest.raises(DecodeError, match=words):
        decode(fields)


def test_array_bytes_that_are_no_whole_number_of_values_raise_decode_error():
    sample = Sample(prompt_ids=[1, 2, 3], completion_ids=[4], completion_logprobs=[0.0], loss_mask=[True])
    fields = RolloutGroup(task_id="t", env="e", example_id="0", samples=[sample]).to_fields()
    payload = unpackb(fields["data"])
    payload["samples"][0]["prompt_ids"] = b"\x01\x00\x00\x00\x02"
    fields["data"] = pack_message(payload)
    with pytest.raises(DecodeError, match="rollout_group v2 does not validate: prompt_ids has 5 bytes, not a whole "
                                          "number of int32 values"):
        decode(as_redis(fields))


def written_before_bare_arrays(message) -> dict[bytes, bytes]:
    """``message``'s entry as a writer before v2 (rollout group) or v3 (micro-batch) made it: arrays as triples."""
    return as_redis(message.to_fields() | {"v": str(message.TRIPLES_BEFORE - 1), "data": packb(message)})


def test_entries_whose_arrays_are_wire_triples_still_read_alike():
    @SETTINGS
    @given(st.one_of(groups, micro_batches()))
    def check(message):
        assert_same(message, decode(written_before_bare_arrays(message)))

    check()


@pytest.mark.parametrize(
    "triple, words",
    [
        (["<i4", [2], b"\x01\x00\x00\x00\x02"], "prompt_ids must be a 1-D <i4 wire array"),
        (["<i4", [3], b"\x01\x00\x00\x00" * 2], "prompt_ids must be a 1-D <i4 wire array"),
        (["<f4", [3], b"\x00" * 12], "prompt_ids must be a 1-D <i4 wire array"),
        (["<i4", [2, 2], b"\x00" * 16], "prompt_ids must be a 1-D <i4 wire array"),
        (["|O", [1], b"\x00" * 8], "prompt_ids must be a 1-D <i4 wire array"),
        ("three", "prompt_ids must be a wire array"),
    ],
)
def test_wire_triples_that_are_no_array_of_their_field_raise_decode_error(triple, words):
    sample = Sample(prompt_ids=[1, 2, 3], completion_ids=[4], completion_logprobs=[0.0], loss_mask=[True])
    fields = written_before_bare_arrays(RolloutGroup(task_id="t", env="e", example_id="0", samples=[sample]))
    payload = unpackb(fields[b"data"])
    payload["samples"][0]["prompt_ids"] = triple
    fields[b"data"] = packb(payload)
    with pytest.raises(DecodeError, match=f"rollout_group v1 does not validate: {words}"):
        decode(fields)


def test_from_fields_rejects_another_kind():
    with pytest.raises(DecodeError, match="expected a 'metric' entry"):
        Metric.from_fields(task_fields())


def one_sample_group(**sample_fields) -> dict[bytes, bytes]:
    """The entry of a one-sample group whose sample's wire fields are replaced by ``sample_fields``."""
    sample = Sample(prompt_ids=[1, 2, 3], completion_ids=[4, 5], completion_logprobs=[-0.5, -0.1],
                    loss_mask=[True, True])
    fields = RolloutGroup(task_id="t", env="e", example_id="0", samples=[sample]).to_fields()
    payload = unpackb(fields["data"])
    payload["samples"][0].update(sample_fields)
    fields["data"] = pack_message(payload)
    return as_redis(fields)


def wire(dtype: str, values: list) -> bytes:
    return np.asarray(values, dtype=dtype).tobytes()


@pytest.mark.parametrize(
    "change, words",
    [
        ({"completion_logprobs": wire("<f4", [-0.5])}, "completion_logprobs has 1 entries for 2 completion tokens"),
        ({"loss_mask": wire("|b1", [True, True, False])}, "loss_mask has 3 entries for 2 completion tokens"),
        ({"teacher_logprobs": wire("<f4", [-1.0])}, "teacher_logprobs has 1 entries for 2 completion tokens"),
        ({"completion_logprobs": wire("<f4", [-0.5, float("nan")])}, "completion_logprobs are not all finite"),
        ({"teacher_logprobs": wire("<f4", [float("-inf"), 0.0])}, "teacher_logprobs are not all finite"),
        ({"reward": float("nan")}, "reward"),
        ({"advantage": float("inf")}, "advantage"),
        ({"temperature": -1.0}, "temperature"),
        ({"completion_logprobs": b"\x00" * 7}, "completion_logprobs has 7 bytes, not a whole number of float32"),
        ({"prompt_ids": ["<i4", [1], b"\x00" * 4]}, "Expected `bytes`, got `array`"),
        ({"loss_mask": "ab"}, "Expected `bytes`, got `str`"),
    ],
)
def test_samples_that_contradict_themselves_raise_decode_error(change, words):
    with pytest.raises(DecodeError, match=words):
        decode(one_sample_group(**change))


def test_a_field_name_that_is_not_utf8_is_ignored_by_the_decoder():
    fields = task_fields()
    fields[b"\xff\xfe-junk"] = b"x"
    assert isinstance(decode(fields), Task)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"sample_lengths": np.array([1, 2], np.int32)}, "sample_lengths sum to 3 but the micro-batch has 4 tokens"),
        ({"loss_mask": np.ones(3, bool)}, "loss_mask has 3 entries for 4 tokens"),
        ({"advantages": np.array([0, 1, np.nan, 0], np.float32)}, "advantages are not all finite"),
        ({"rewards": np.array([1.0, 2.0, 3.0], np.float32)}, "rewards has 3 entries for 2 samples"),
        ({"index": 2}, "index 2 is not below count 2"),
        ({"input_ids": np.array([1, 2, -3, 4], np.int32)}, "negative token id"),
    ],
)
def test_micro_batches_that_contradict_themselves_are_rejected(change, words):
    good = dict(step=1, index=0, count=2, mode="rl", input_ids=np.array([1, 2, 3, 4], np.int32),
                position_ids=np.array([0, 1, 0, 1], np.int32), loss_mask=np.array([0, 1, 0, 1], bool),
                advantages=np.zeros(4, np.float32), inference_logprobs=np.zeros(4, np.float32),
                temperatures=np.ones(4, np.float32), sample_lengths=np.array([2, 2], np.int32),
                policy_versions=np.zeros(2, np.int32), rewards=np.zeros(2, np.float32))
    with pytest.raises(ValueError, match=words):  # where it is built
        MicroBatch(**(good | change))
    fields = MicroBatch(**good).to_fields()  # and where it is read
    payload = unpackb(fields["data"]) | change
    fields["data"] = pack_message(payload)
    with pytest.raises(DecodeError, match=words):
        decode(as_redis(fields))


def test_each_sample_knows_its_task_and_its_place_in_the_group_through_filtering():
    samples = [Sample(prompt_ids=[1], completion_ids=[2], completion_logprobs=[-1.0], loss_mask=[True], reward=r)
               for r in (0.0, 1.0, 0.5)]
    group = RolloutGroup(task_id="e:0:7", env="e", example_id="7", samples=samples)
    assert [(s.task_id, s.index) for s in group.samples] == [("e:0:7", 0), ("e:0:7", 1), ("e:0:7", 2)]
    filtered = group.replace(samples=[group.samples[0], group.samples[2]])
    back = decode(as_redis(filtered.to_fields()))
    assert [(s.task_id, s.index) for s in back.samples] == [("e:0:7", 0), ("e:0:7", 2)]
    stranger = Sample(prompt_ids=[1], completion_ids=[2], completion_logprobs=[-1.0], loss_mask=[True], task_id="x")
    with pytest.raises(ValueError, match="a sample of task 'x' in the group of task 'e:0:7'"):
        RolloutGroup(task_id="e:0:7", env="e", example_id="7", samples=[stranger])


def test_a_weight_update_is_v2_only_when_it_carries_an_adapter():
    from bus.arrays import unpackb
    from bus.messages import WeightUpdate, decode

    whole = WeightUpdate(step=3, format="safetensors", dir="/w/step_3").to_fields()
    assert whole["v"] == "1" and "adapter" not in unpackb(whole["data"])  # a v1 reader takes it
    assert decode(whole).adapter is None
    lora = WeightUpdate(step=3, format="safetensors", dir="/w/step_3", adapter="r8-a16-step3").to_fields()
    assert lora["v"] == "2" and lora["adapter"] == "r8-a16-step3" and decode(lora).adapter == "r8-a16-step3"


def test_a_reader_before_bare_arrays_refuses_new_entries_by_name():
    group = RolloutGroup(task_id="t", env="e", example_id="0", samples=[
        Sample(prompt_ids=[1], completion_ids=[2], completion_logprobs=[-1.0], loss_mask=[True])])
    fields = as_redis(group.to_fields())
    assert fields[b"v"] == b"2"

    class RolloutGroupV1(RolloutGroup, kw_only=True):
        V = 1

    with pytest.raises(DecodeError, match="rollout_group schema v=2 is newer than this reader's v=1; upgrade rlbus"):
        RolloutGroupV1.from_fields(fields)
