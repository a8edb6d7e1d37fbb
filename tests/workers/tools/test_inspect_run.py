"""rlbus inspect --audit: what was trained, read from batches:*; a sample trained twice is named. --latency: the
per-hop breakdown of a run written by hand, entry ids included."""

import numpy as np
import pytest

from bus.keys import Keys
from bus.messages import MicroBatch
from tests.workers.tools.test_exporter import write_run
from workers.tools.inspect_run import audit, format_audit, format_latency, latency


def micro_batch(step: int, task_ids: list[str], indices: list[int]) -> MicroBatch:
    k = len(task_ids)
    return MicroBatch(step=step, index=0, count=1, mode="rl", input_ids=np.ones(k, np.int32),
                      position_ids=np.zeros(k, np.int32), loss_mask=np.ones(k, bool),
                      advantages=np.zeros(k, np.float32),
                      inference_logprobs=np.zeros(k, np.float32), temperatures=np.ones(k, np.float32),
                      sample_lengths=np.ones(k, np.int32), policy_versions=np.zeros(k, np.int32),
                      rewards=np.zeros(k, np.float32), task_ids=task_ids, sample_indices=np.array(indices, np.int32))


def test_audit_names_what_was_trained_twice(redis_client, run_name):
    keys = Keys(run_name)
    redis_client.xadd(keys.batches(1), micro_batch(1, ["e:0:1", "e:0:1", ""], [0, 1, 0]).to_fields())
    redis_client.xadd(keys.batches(2), micro_batch(2, ["e:0:2", "e:0:1"], [0, 1]).to_fields())
    result = audit(redis_client, keys)
    assert result["samples"] == 4 and result["micro_batches"] == 2 and result["steps"] == 2
    assert result["trained_twice"] == [{"task_id": "e:0:1", "index": 1, "steps": [1, 2]}]
    assert "trained twice: e:0:1 sample 1 at steps 1, 2" in format_audit(result)
    redis_client.delete(keys.batches(2))
    assert audit(redis_client, keys)["trained_twice"] == []


def test_latency_breaks_a_samples_time_down_by_hop(redis_client, run_name):
    keys = Keys(run_name)
    write_run(redis_client, keys)
    result = latency(redis_client, keys, 0.3)
    assert result["envs"] == ["rev"]
    means = {hop: row["mean_s"] for hop, row in result["hops"].items()}
    assert means == pytest.approx({"queued": 0.5, "generating": 1.5, "filtering": 0.2, "packing": 0.8,
                                   "training": 0.5})
    assert all(row["count"] == 1 for row in result["hops"].values())
    text = format_latency(result)
    assert "queued" in text.splitlines()[2] and "0.500" in text.splitlines()[2]
