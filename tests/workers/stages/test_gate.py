"""The staleness gate: the admission rule, and waiting on real `policy` events."""

import asyncio

import pytest

from bus.messages import PolicyVersion
from bus.policy import PolicyTracker, publish_served
from tests.policy import publish_trained
from workers.stages.gate import StalenessGate, admits


@pytest.mark.parametrize("served,trained,off,prefetch,eval_step,ok", [
    (0, 0, 0, 0, None, True),    # strictly on-policy: step 1 trains policy 0, served 0
    (4, 5, 0, 0, None, False),   # step 6 trains policy 5: on-policy needs served 5
    (5, 5, 0, 0, None, True),
    (2, 5, 2, 0, None, False),   # step 6 trains policy 5; 2 behind is 3 > served 2
    (3, 5, 2, 0, None, True),
    (3, 5, 2, 1, None, False),   # the packer builds step 7 next (policy 6): 6 − 2 = 4 > 3
    (4, 5, 2, 1, None, True),
    (4, 100, 1, 1, 4, True),     # eval: never stale
    (3, 0, 8, 1, 4, False),      # eval waits for its version
])
def test_admits(served, trained, off, prefetch, eval_step, ok):
    assert admits(served, trained, off, prefetch, eval_step) is ok



@pytest.mark.parametrize("served,trained,packed,ok", [
    (4, 5, 6, True),    # the packer has not reached its limit (step 7): the next step, 7, keeps policy ≥ 4
    (4, 5, 7, False),   # it built step 7 already: a group started now lands in step 8, which keeps policy ≥ 5
    (5, 5, 7, True),
])
def test_admits_counts_the_steps_already_packed(served, trained, packed, ok):
    assert admits(served, trained, 2, 1, packed=packed) is ok

async def test_gate_blocks_while_served_lags_and_releases_on_new_served(bus):
    async with bus("trainer", block_ms=50) as b:
        await publish_trained(b, 3)
        await publish_served(b, "s0", 1)
        gate = StalenessGate(PolicyTracker(b), max_off_policy_steps=2, prefetch_steps=1, block_ms=50)
        waiter = asyncio.create_task(gate.wait())  # next packed step 5 trains policy 4; 4 − 2 = 2 > served 1
        await asyncio.sleep(0.3)
        assert not waiter.done()
        await publish_served(b, "s1", 2)  # a second server: min(served) stays 1
        await asyncio.sleep(0.2)
        assert not waiter.done()
        await publish_served(b, "s0", 2)
        waited = await asyncio.wait_for(waiter, 2)
        assert waited >= 0.4
        assert gate.is_open()
        eval_waiter = asyncio.create_task(gate.wait(eval_step=3))
        await asyncio.sleep(0.2)
        assert not eval_waiter.done()
        for server in ("s0", "s1"):
            await b.publish(b.keys.policy(), PolicyVersion(role="served", step=3, server=server))
        await asyncio.wait_for(eval_waiter, 2)
        stop = asyncio.Event()
        stop.set()
        await asyncio.wait_for(gate.wait(eval_step=9, stop=stop), 2)  # a stop request ends the wait
        assert not gate.is_open(eval_step=9)


async def test_an_eval_group_passes_at_once_while_training_groups_wait(bus):
    """Training groups held at the gate (served pinned by the eval hold) share one blocking read of the policy
    stream: an eval group whose version is served passes at once instead of queueing behind each of their reads."""
    async with bus("trainer") as b:
        await publish_trained(b, 103)
        await publish_served(b, "s0", 100)  # next packed step 105 keeps policy ≥ 102: training is held
        gate = StalenessGate(PolicyTracker(b), max_off_policy_steps=2, prefetch_steps=1, block_ms=1_000)
        held = [asyncio.create_task(gate.wait()) for _ in range(6)]
        await asyncio.sleep(0.1)
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(gate.wait(eval_step=100), 5)
        assert asyncio.get_running_loop().time() - started < 0.5
        assert not any(task.done() for task in held)
        await publish_served(b, "s0", 102)
        await asyncio.wait_for(asyncio.gather(*held), 3)  # one read wakes every waiter
