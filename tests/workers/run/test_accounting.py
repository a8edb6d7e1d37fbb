"""The run's group accounting: which dead letters count as dead-lettered training groups."""

from bus.messages import DeadLetter, RolloutGroup, Sample
from workers.run.accounting import dead_groups


def group(eval_step: int | None) -> RolloutGroup:
    sample = Sample(prompt_ids=[1], completion_ids=[2], completion_logprobs=[-1.0], loss_mask=[True])
    return RolloutGroup(task_id="e:0:0", env="e", example_id="0", eval_step=eval_step, samples=[sample])


async def test_only_training_groups_dead_lettered_from_rollouts_or_filtered_count(bus):
    async with bus("w") as b:
        def letter(stream: str, fields: dict) -> DeadLetter:
            return DeadLetter(stream=stream, entry_id="1-0", reason="r", fields=fields)

        def as_fields(message) -> dict:
            return {k: v if isinstance(v, bytes) else v.encode() for k, v in message.to_fields().items()}

        training, evaluation = as_fields(group(None)), as_fields(group(0))
        await b.publish_many(b.keys.dead(), [
            letter(b.keys.rollouts("e"), training),
            letter(b.keys.filtered("e"), training),
            letter(b.keys.rollouts("e"), evaluation),  # an eval group
            letter(b.keys.tasks("e"), training),  # not from rollouts or filtered
            letter(b.keys.rollouts("e"), {"data": b"garbage"}),  # never was a group
        ])
        await b.redis.xadd(b.keys.dead(), {"kind": "nonsense"})  # not even a dead letter
        assert await dead_groups(b) == 2
