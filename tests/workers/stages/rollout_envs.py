"""Test-only environments for the rollout worker's tests (loaded by spawned env servers via import path)."""

import time

from workers.envs.base import Environment, RewardFunc, Rubric


def slow_echo(n: int = 20, step_s: float = 1.5) -> Environment:
    """Single-turn env whose step takes ``step_s`` seconds, so a test can act while a group runs."""

    class Slow(Environment):
        def step(self, index, messages, state):
            time.sleep(step_s)
            return super().step(index, messages, state)

    data = [{"text": f"item {i}"} for i in range(n)]
    return Slow("slow_echo", data, lambda ex: [{"role": "user", "content": ex["text"]}],
                Rubric([RewardFunc(lambda ex, messages, state: 1.0, name="one")]))


def unstartable_while(flag: str, n: int = 20) -> Environment:
    """A plain echo env that cannot start while the file ``flag`` exists (a spawned server that cannot restart)."""
    from pathlib import Path

    if Path(flag).exists():
        raise RuntimeError(f"{flag} exists: this env server cannot start now")
    return slow_echo(n, step_s=0.01)
