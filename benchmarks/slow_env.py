"""``echo_chars`` whose ``score`` awaits ``delay_s`` first: an env that waits on something remote (a sandbox, a
judge) without holding a thread of its server. Used by ``benchmarks/concurrency.py`` as
``id = "benchmarks.slow_env:load_environment"``."""

import asyncio

from workers.envs import echo_chars
from workers.envs.base import Environment


def load_environment(delay_s: float = 0.2, **args) -> Environment:
    env = echo_chars.load_environment(**args)

    class Slow(type(env)):
        async def score(self, index, messages, state):
            await asyncio.sleep(delay_s)
            return Environment.score(self, index, messages, state)

    env.__class__ = Slow
    return env
