"""Views: what the exporter reads of a group or a micro-batch, the same as the whole message says; never another
kind; entries written before bare arrays read whole."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bus.arrays import pack_message, unpackb
from bus.errors import DecodeError
from bus.messages import RolloutGroup, Sample, Task
from bus.views import BatchView, GroupView, decode_view
from tests.bus.test_messages import SETTINGS, as_redis, groups, micro_batches, written_before_bare_arrays


def same_view(view, message) -> None:
    for name in type(view).__struct_fields__:
        value, expected = getattr(view, name), getattr(message, name)
        if isinstance(expected, np.ndarray):
            np.testing.assert_array_equal(value, expected)
        else:
            assert value == expected, name


def test_a_view_reads_what_the_whole_message_says_in_either_schema():
    @SETTINGS
    @given(st.one_of(groups, micro_batches()), st.booleans())
    def check(message, older):
        view = GroupView if isinstance(message, RolloutGroup) else BatchView
        fields = written_before_bare_arrays(message) if older else as_redis(message.to_fields())
        same_view(decode_view(view, fields), message)

    check()


def test_a_view_skips_the_samples_the_stages_check_and_refuses_another_kind():
    sample = Sample(prompt_ids=[1], completion_ids=[2], completion_logprobs=[0.0], loss_mask=[True])
    fields = RolloutGroup(task_id="t", env="e", example_id="0", samples=[sample], timings={"total_s": 1.5}).to_fields()
    payload = unpackb(fields["data"])
    payload["samples"][0]["reward"] = float("nan")  # the filter dead-letters this group; its hops still count
    fields["data"] = pack_message(payload)
    view = decode_view(GroupView, as_redis(fields))
    assert (view.task_id, view.eval_step, view.timings) == ("t", None, {"total_s": 1.5})
    task = as_redis(Task(task_id="t", env="e", example_id="0", example_index=0, group_size=1).to_fields())
    with pytest.raises(DecodeError, match="expected a rollout_group entry, got 'task'"):
        decode_view(GroupView, task)
