"""rlbus inspect --audit: what was trained, read from batches:*; a sample trained twice is named."""

import numpy as np

from bus.keys import Keys
from bus.messages import MicroBatch
from workers.tools.inspect_run import audit, format_audit


def micro_batch(step: int, task_ids: list[str], indices: list[int]) -> MicroBatch:
    k = len(task_ids)
    return MicroBatch(step=step, index=0, count=1, mode="rl", input_ids=np.ones(k, np.int32),
                      position_ids=np.zeros(k, np.int32), loss_mask=np.ones(k, bool), advantages=np.zeros(k, np.float32),
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
