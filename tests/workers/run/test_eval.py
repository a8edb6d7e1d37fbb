"""Eval math (pass@k, eval values, which steps are due) and the coordinator: dead tasks, timeouts."""

import asyncio

import pytest

from bus.messages import RolloutGroup, Sample, Task
from bus.state import EVAL_HOLD_FIELD
from tests.policy import publish_trained
from workers.config import RlbusConfig
from workers.run.eval import EvalCoordinator, eval_steps_due, eval_values, k_values, next_eval_step, pass_at_k


def test_pass_at_k_hand_computed():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 3, 2) == 1.0  # n - c < k: every k-subset has a correct one
    with pytest.raises(ValueError, match="c ≤ n"):
        pass_at_k(2, 3, 1)


def test_eval_values_binary_and_continuous():
    assert k_values(8) == [1, 2, 4, 8] and k_values(6) == [1, 2, 4, 6] and k_values(1) == [1]
    binary = eval_values("e", [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    assert binary["eval/e/reward"] == pytest.approx(3 / 8)
    assert binary["eval/e/pass@1"] == pytest.approx((0.25 + 0.5) / 2)
    assert binary["eval/e/pass@4"] == pytest.approx(1.0)
    continuous = eval_values("e", [[0.5, 0.25]])
    assert continuous == {"eval/e/reward": pytest.approx(0.375), "eval/e/examples": 1.0}


def test_eval_steps_due():
    assert eval_steps_due(0, None, 10, 30, skip_first=False) == 0
    assert eval_steps_due(0, None, 10, 30, skip_first=True) is None
    assert eval_steps_due(9, 0, 10, 30, skip_first=False) is None
    assert eval_steps_due(10, 0, 10, 30, skip_first=False) == 10
    assert eval_steps_due(10, 10, 10, 30, skip_first=False) is None
    assert eval_steps_due(23, 0, 10, 30, skip_first=False) == 10  # in order: the oldest not yet issued
    assert eval_steps_due(25, 20, 10, 25, skip_first=False) == 25  # max_steps always evaluated
    assert next_eval_step(None, 10, 25, skip_first=True) == 10
    assert next_eval_step(10, 10, 25, skip_first=False) == 20
    assert next_eval_step(20, 10, 25, skip_first=False) == 25
    assert next_eval_step(25, 10, 25, skip_first=False) is None
    assert next_eval_step(3, 10, None, skip_first=False) == 10


def eval_config(redis_url: str, run_name: str, timeout_s: float | None) -> RlbusConfig:
    return RlbusConfig.model_validate({
        "run": {"name": run_name, "max_steps": 10},
        "redis": {"url": redis_url, "block_ms": 50},
        "eval": {"interval": 5, "timeout_s": timeout_s,
                 "env": [{"id": "reverse_text", "name": "rev_eval", "num_examples": 3, "group_size": 1}]},
    })


def eval_group(task: Task, reward: float) -> RolloutGroup:
    sample = Sample(prompt_ids=[1], completion_ids=[2], completion_logprobs=[-1.0], loss_mask=[True], reward=reward)
    return RolloutGroup(task_id=task.task_id, env=task.env, example_id=task.example_id,
                        example_index=task.example_index, eval_step=task.eval_step, samples=[sample])


async def test_a_dead_lettered_eval_task_counts_as_done_and_a_stuck_eval_times_out(bus, redis_url, run_name):
    async with bus("run") as b:
        coordinator = EvalCoordinator(eval_config(redis_url, run_name, timeout_s=0.5), b, {"rev_eval": 50})
        await coordinator.setup()
        assert await b.state_get(EVAL_HOLD_FIELD) == "0"
        await coordinator.issue_due()  # step 0: three tasks
        entries = await b.read_group([b.keys.tasks("rev_eval")], "rollout", count=10)
        tasks = [e.message for e in entries]
        assert len(tasks) == 3
        await b.publish(b.keys.rollouts("rev_eval"), eval_group(tasks[0], 1.0))
        await b.publish(b.keys.rollouts("rev_eval"), eval_group(tasks[1], 0.0))
        await b.dead_letter(entries[2], reason="env broke")
        await coordinator.collect(block_ms=100)
        assert coordinator.complete(0)
        (_, metric), = [m for m in await b.read_fanout(b.keys.metrics()) if m[1].source == "eval"]
        assert metric.values["eval/rev_eval/reward"] == 0.5 and metric.values["eval/rev_eval/groups_missing"] == 1
        assert await b.state_get(EVAL_HOLD_FIELD) == "5"  # the next eval step: interval 5

        await publish_trained(b, 5)
        await coordinator.issue_due()  # step 5: no rollout worker answers
        await coordinator.collect(block_ms=100)
        assert not coordinator.complete(5)
        await asyncio.sleep(0.6)
        await coordinator.collect(block_ms=100)
        assert coordinator.complete(5)
        metrics = [m.values for _, m in await b.read_fanout(b.keys.metrics()) if m.source == "eval" and m.step == 5]
        assert metrics[-1]["eval/rev_eval/groups_missing"] == 3 and metrics[-1]["eval/rev_eval/timed_out"] == 1
        assert await b.state_get(EVAL_HOLD_FIELD) == "10"


async def test_a_restarted_coordinator_replays_its_pending_eval_groups_and_acks_training_groups_unread(
    bus, redis_url, run_name
):
    async with bus("run") as b:
        config = eval_config(redis_url, run_name, timeout_s=None)
        first = EvalCoordinator(config, b, {"rev_eval": 50})
        await first.setup()
        await first.issue_due()
        tasks = [e.message for e in await b.read_group([b.keys.tasks("rev_eval")], "rollout", count=10)]
        rollouts = b.keys.rollouts("rev_eval")
        training = RolloutGroup(task_id="rev:0:0", env="rev_eval", example_id="0", samples=[])
        await b.publish(rollouts, training)
        await b.publish(rollouts, eval_group(tasks[0], 1.0))
        await first.collect(block_ms=100)
        assert (await b.redis.xpending(rollouts, "eval"))["pending"] == 1  # the training group: acked unread

        second = EvalCoordinator(config, b, {"rev_eval": 50})  # the same consumer, restarted
        await second.setup()
        assert set(second.pending[("rev_eval", 0)].groups) == {tasks[0].task_id}
        for task in tasks[1:]:
            await b.publish(rollouts, eval_group(task, 0.0))
        await second.collect(block_ms=100)
        assert second.complete(0)
        assert (await b.redis.xpending(rollouts, "eval"))["pending"] == 0


async def test_each_eval_is_issued_when_its_step_is_trained_and_issuing_ends_after_the_last(bus, redis_url, run_name):
    async with bus("run") as b:
        coordinator = EvalCoordinator(eval_config(redis_url, run_name, timeout_s=None), b, {"rev_eval": 50})
        await coordinator.setup()
        issuing = asyncio.ensure_future(coordinator.issue_on_time(block_ms=5000))  # woken by events, not the block

        async def issued_steps(count: int) -> list[int]:
            entries = await b.read_group([b.keys.tasks("rev_eval")], "rollout", count=10, block_ms=2000)
            assert len(entries) == count
            return sorted({e.message.eval_step for e in entries})

        assert await issued_steps(3) == [0]
        await publish_trained(b, 4)
        assert await b.read_group([b.keys.tasks("rev_eval")], "rollout", count=10, block_ms=300) == []
        await publish_trained(b, 5)
        assert await issued_steps(3) == [5]
        assert not issuing.done()
        await publish_trained(b, 10)  # max_steps: the last eval
        assert await issued_steps(3) == [10]
        await asyncio.wait_for(issuing, timeout=2)
        assert coordinator.next_due() is None
