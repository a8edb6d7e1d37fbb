"""The weights follower: collapsing events, the eval hold."""

import asyncio
import time
from pathlib import Path

from bus.messages import WeightFile, WeightUpdate
from bus.state import EVAL_HOLD_FIELD
from bus.weight_files import sha256_of
from workers.inference.weights_follower import WeightsFollower, _collapse


def written(root: Path, step: int, content: bytes = b"weights") -> WeightUpdate:
    """A safetensors event of ``step`` whose one file lies under ``root`` (the follower checks both)."""
    path = root / f"step_{step}" / "model.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content + bytes([step]))
    files = [WeightFile(name=path.name, bytes=path.stat().st_size, sha256=sha256_of(path))]
    return WeightUpdate(step=step, format="safetensors", dir=str(path.parent), files=files)


def test_weight_events_collapse_but_broadcasts_are_all_joined():
    s = [WeightUpdate(step=i, format="safetensors", dir=f"/w/{i}") for i in range(1, 4)]
    n = WeightUpdate(step=4, format="nccl", host="h", port=1, world_size=2)
    assert [e.step for e in _collapse([s[0], s[1], n, s[2]])] == [2, 4, 3]


async def test_eval_hold_keeps_newer_safetensors_updates_back(bus, run_name, tmp_path):
    """eval:hold=1: step 1 is served, step 2 waits (also for a follower started later) until the hold moves to 2;
    nccl broadcasts are never held."""
    async with bus("trainer") as b:
        await b.state_set(**{EVAL_HOLD_FIELD: 1})
        ids = [await b.publish(b.keys.weights(), written(tmp_path, s)) for s in (1, 2)]
        applied: dict[str, list[int]] = {"early": [], "late": []}

        def follower(name: str) -> WeightsFollower:
            async def apply(event: WeightUpdate) -> None:
                applied[name].append(event.step)

            return WeightsFollower(b, name, apply, tmp_path, block_ms=100)

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


async def test_a_released_hold_is_served_long_before_the_next_blocking_read(bus, tmp_path):
    """The eval is over (the hold moves on): the held step is served at once, not after the next blocking read
    (``block_ms``, 1 s by default), so training is not held up that long per eval."""
    async with bus("trainer") as b:
        await b.state_set(**{EVAL_HOLD_FIELD: 1})
        for step in (1, 2):
            await b.publish(b.keys.weights(), written(tmp_path, step))
        served = asyncio.Event()

        async def apply(event: WeightUpdate) -> None:
            if event.step == 2:
                served.set()

        task = asyncio.create_task(WeightsFollower(b, "s0", apply, tmp_path, block_ms=5_000).run())
        await asyncio.sleep(0.3)
        assert not served.is_set()
        released = time.monotonic()
        await b.state_set(**{EVAL_HOLD_FIELD: 2})
        await asyncio.wait_for(served.wait(), 10)
        assert time.monotonic() - released < 1.0
        task.cancel()


async def test_garbage_as_the_newest_weights_entry_does_not_stop_a_server_from_starting(bus, tmp_path):
    async with bus("trainer") as b:
        await b.publish(b.keys.weights(), written(tmp_path, 1))
        await b.redis.xadd(b.keys.weights(), {b"kind": b"weight_update", b"v": b"1", b"data": b"\xc1"})
        applied = []

        async def apply(event: WeightUpdate) -> None:
            applied.append(event.step)

        follower = WeightsFollower(b, "s1", apply, tmp_path, block_ms=100)
        await follower.start()
        assert applied == [1] and follower.step == 1


async def test_only_weights_under_the_root_that_match_their_event_are_loaded(bus, tmp_path):
    async with bus("trainer") as b:
        root, elsewhere = tmp_path / "run" / "weights", tmp_path / "elsewhere"
        outside = written(elsewhere, 1)
        changed = written(root, 2)
        Path(changed.dir, "model.safetensors").write_bytes(b"tampered")
        good = written(root, 3)
        applied = []

        async def apply(event: WeightUpdate) -> None:
            applied.append(event.step)

        follower = WeightsFollower(b, "s1", apply, root, block_ms=100)
        assert not await follower._load(outside) and not await follower._load(changed)
        assert await follower._load(good)
        assert applied == [3] and follower.step == 3


async def test_a_directory_still_being_written_is_waited_for_with_wait_for_weights_timeout(bus, tmp_path):
    async with bus("trainer") as b:
        root = tmp_path / "weights"
        event = written(root, 1)
        shard = Path(event.dir, "model.safetensors")
        content = shard.read_bytes()
        shard.unlink()  # the event came before the file (a trainer still saving, a lagging shared disk)
        applied = []

        async def apply(e: WeightUpdate) -> None:
            applied.append(e.step)

        impatient = WeightsFollower(b, "s1", apply, root, block_ms=100)
        assert not await impatient._load(event)  # None: skipped at once

        async def finish_writing() -> None:
            await asyncio.sleep(0.7)
            shard.write_bytes(content)

        patient = WeightsFollower(b, "s2", apply, root, block_ms=100, wait_for_weights_s=10)
        loaded, _ = await asyncio.gather(patient._load(event), finish_writing())
        assert loaded and applied == [1]


def test_adapter_updates_are_never_collapsed():
    def whole(step):
        return WeightUpdate(step=step, format="safetensors", dir=f"/w/step_{step}")

    def adapter(step):
        return WeightUpdate(step=step, format="safetensors", dir=f"/w/step_{step}", adapter=f"r8-a16-step{step}")

    # vLLM serves LoRA versions side by side: a request may name any of them, so each one is loaded
    assert [e.step for e in _collapse([adapter(1), adapter(2), adapter(3)])] == [1, 2, 3]
    assert [e.step for e in _collapse([whole(1), whole(2), whole(3)])] == [3]
