"""Groups, configs and stream reads shared by the filter and packer worker tests."""

from pathlib import Path

import numpy as np

from bus.messages import MicroBatch, RolloutGroup, Sample
from workers.config import RlbusConfig

ENV = "rev"


def group(uid: int, rewards: list[float], version: int = 0, advantage: float = 0.5) -> RolloutGroup:
    samples = [
        Sample(
            prompt_ids=np.full(3, uid, np.int32),
            completion_ids=np.arange(5, dtype=np.int32),
            completion_logprobs=np.full(5, -1.0, np.float32),
            loss_mask=np.ones(5, bool),
            reward=r,
            advantage=advantage,
            policy_version_start=version,
            policy_version_end=version,
        )
        for r in rewards
    ]
    return RolloutGroup(task_id=f"{ENV}:0:{uid}", env=ENV, example_id=str(uid), samples=samples)


def config(redis_url: str, run_name: str, model_dir: Path, **packer) -> RlbusConfig:
    return RlbusConfig.model_validate(
        {
            "run": {"name": run_name},
            "redis": {"url": redis_url, "block_ms": 100},
            "model": {"path": str(model_dir)},
            "env": [{"id": "reverse_text", "name": ENV, "group_size": 2}],
            "packer": {"batch_size": 4, "seq_len": 32, **packer},
        }
    )


async def micro_batches(bus, step: int) -> list[MicroBatch]:
    rows = await bus.redis.xrange(bus.keys.batches(step))
    return [MicroBatch.from_fields(fields) for _, fields in rows]


async def pending(bus, stream: str, group: str) -> int:
    return int((await bus.redis.xpending(stream, group))["pending"])


async def read_all(packer) -> None:
    """What a started packer reads first: its own pending entries (replay), then the new ones."""
    while packer._replay:
        await packer._read(reclaim=False)
    await packer._read(reclaim=False)
