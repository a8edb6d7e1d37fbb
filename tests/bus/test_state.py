"""The state hash: the in-flight count recomputed from the streams, inside Redis, corrects any drift."""


import numpy as np

from bus.keys import GROUP_FILTER, GROUP_ROLLOUT
from bus.messages import RolloutGroup, Sample, Task
from bus.state import INFLIGHT_FIELD, reconcile_inflight


def group(task_id: str, samples: int, eval_step: int | None = None) -> RolloutGroup:
    sample = Sample(prompt_ids=np.ones(2, np.int32), completion_ids=np.ones(3, np.int32),
                    completion_logprobs=np.zeros(3, np.float32), loss_mask=np.ones(3, bool))
    return RolloutGroup(task_id=task_id, env="e", example_id="0", samples=[sample] * samples, eval_step=eval_step)


async def test_the_in_flight_count_is_recomputed_from_the_streams_and_drift_corrected(bus):
    async with bus("w1") as b:
        tasks, rollouts, filtered = b.keys.tasks("e"), b.keys.rollouts("e"), b.keys.filtered("e")
        await b.publish_many(tasks, [Task(task_id=f"e:0:{i}", env="e", example_index=i, example_id=str(i),
                                          group_size=4) for i in range(3)])
        await b.publish(tasks, Task(task_id="eval:e:0:0", env="e", example_index=0, example_id="0", group_size=4,
                                    eval_step=0))  # eval work is never counted
        await b.redis.xadd(tasks, {b"kind": b"task", b"v": b"1", b"data": b"\xc1"})  # garbage: never counted
        (done,) = await b.read_group([tasks], GROUP_ROLLOUT, count=1)  # one task taken: still in flight...
        await b.ack(tasks, GROUP_ROLLOUT, [done.id])  # ...until its group is published: now acked
        await b.publish(rollouts, group("e:0:0", 4))
        await b.ensure_group(rollouts, GROUP_FILTER)
        await b.read_group([rollouts], GROUP_FILTER)  # pending at the filter: in flight
        await b.publish(filtered, group("e:0:9", 3))  # 3 kept after filtering, waiting for the packer
        await b.state_set(**{INFLIGHT_FIELD: 40})  # drifted (a lost release, say)
        assert await reconcile_inflight(b, ["e"]) == (40, 2 * 4 + 4 + 3)
        assert await b.state_get(INFLIGHT_FIELD) == "15"
        assert await reconcile_inflight(b, ["e"]) == (15, 15)  # no drift: nothing written
