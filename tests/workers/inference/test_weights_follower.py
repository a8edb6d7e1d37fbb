"""The weights follower: collapsing events, the eval hold."""

import asyncio

from workers.inference.weights_follower import _collapse


def test_weight_events_collapse_but_broadcasts_are_all_joined():
    from bus.messages import WeightUpdate

    s = [WeightUpdate(step=i, format="safetensors", dir=f"/w/{i}") for i in range(1, 4)]
    n = WeightUpdate(step=4, format="nccl", host="h", port=1, world_size=2)
    assert [e.step for e in _collapse([s[0], s[1], n, s[2]])] == [2, 4, 3]


def test_eval_hold_keeps_newer_safetensors_updates_back(bus, run_name):
    """eval:hold=1: step 1 is served, step 2 waits (also for a follower started later) until the hold moves to 2;
    nccl broadcasts are never held."""
    from bus.messages import WeightUpdate
    from bus.state import EVAL_HOLD_FIELD
    from workers.inference.weights_follower import WeightsFollower

    async def main():
        async with bus("trainer") as b:
            await b.state_set(**{EVAL_HOLD_FIELD: 1})
            ids = [await b.publish(b.keys.weights(), WeightUpdate(step=s, format="safetensors", dir=f"/w/{s}"))
                   for s in (1, 2)]
            applied: dict[str, list[int]] = {"early": [], "late": []}

            def follower(name: str) -> WeightsFollower:
                async def apply(event: WeightUpdate) -> None:
                    applied[name].append(event.step)

                return WeightsFollower(b, name, apply, block_ms=100)

            async def until(expected: dict) -> None:
                for _ in range(50):
                    if applied == expected:
                        return
                    await asyncio.sleep(0.05)
                assert applied == expected

            early, late = follower("early"), follower("late")
            tasks = [asyncio.create_task(early.run())]
            await late.start()  # catches up to the newest event that is not held: step 1
            tasks.append(asyncio.create_task(late.run()))
            await asyncio.sleep(0.5)
            assert applied == {"early": [1], "late": [1]} and early.step == late.step == 1
            assert early.last_id == late.last_id == ids[0]  # not past the held step 2
            await b.state_set(**{EVAL_HOLD_FIELD: 2})
            await until({"early": [1, 2], "late": [1, 2]})
            await b.publish(b.keys.weights(), WeightUpdate(step=3, format="nccl", host="h", port=1, world_size=3))
            await until({"early": [1, 2, 3], "late": [1, 2, 3]})
            for task in tasks:
                task.cancel()

    asyncio.run(main())


def test_garbage_as_the_newest_weights_entry_does_not_stop_a_server_from_starting(bus):
    from bus.messages import WeightUpdate
    from workers.inference.weights_follower import WeightsFollower

    async def main():
        async with bus("trainer") as b:
            await b.publish(b.keys.weights(), WeightUpdate(step=1, format="safetensors", dir="/w/1"))
            await b.redis.xadd(b.keys.weights(), {b"kind": b"weight_update", b"v": b"1", b"data": b"\xc1"})
            applied = []

            async def apply(event: WeightUpdate) -> None:
                applied.append(event.step)

            follower = WeightsFollower(b, "s1", apply, block_ms=100)
            await follower.start()
            assert applied == [1] and follower.step == 1

    asyncio.run(main())
