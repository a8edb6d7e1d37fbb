"""Test-only environments whose user code hangs (loaded by spawned env servers via import path)."""

import time

from workers.envs.base import Environment, RewardFunc, Rubric


def hangs_on_zero(n: int = 8) -> Environment:
    """An env whose ``example(0)`` never returns (as user code stuck on a lock or a dead socket); the rest answer."""

    class Hangs(Environment):
        def example(self, index):
            if index == 0:
                time.sleep(3600)
            return super().example(index)

    data = [{"text": f"item {i}"} for i in range(n)]
    return Hangs("hangs_on_zero", data, lambda ex: [{"role": "user", "content": ex["text"]}],
                 Rubric([RewardFunc(lambda ex, messages, state: 1.0, name="one")]))
