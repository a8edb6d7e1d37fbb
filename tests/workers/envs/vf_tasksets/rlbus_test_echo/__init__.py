"""A verifiers v1 taskset written for rlbus's tests (``taskset = { id = "rlbus-test-echo" }``): echo a character.

Single-turn: the prompt is a run of one printable character (``"kkkk"``); the reward ``closeness`` is the mean, over
the reply's first 4 characters, of ``max(0, 1 - d / 12)`` with ``d`` the distance to the prompt's character on the
ring of printable ASCII: a random byte-level model earns a little (≈ 0.06), so GRPO has signal from the first step,
and echoing earns 1. Metric ``exact``: the share of those characters equal to it. Each task's ``answer`` (the field
verifiers' reference judge reads) is the echo, for sft from references.
"""

import random

import verifiers.v1 as vf

__all__ = ["EchoTaskset"]

FIRST, LAST = 33, 126
RING = LAST - FIRST + 1


class EchoConfig(vf.TasksetConfig):
    num_tasks: int = 64
    """Tasks in the taskset."""
    seed: int = 0
    """Which characters the tasks ask for."""


class EchoData(vf.TaskData):
    char: str
    answer: str


def credit(char: str, target: str, width: float = 12.0) -> float:
    if not FIRST <= ord(char) <= LAST:
        return 0.0
    d = abs(ord(char) - ord(target))
    return max(0.0, 1.0 - min(d, RING - d) / width)


class EchoTask(vf.Task[EchoData]):
    @vf.reward
    async def closeness(self, trace) -> float:
        counted = trace.last_reply[:4]
        return sum(credit(c, self.data.char) for c in counted) / 4

    @vf.metric
    async def exact(self, trace) -> float:
        return sum(c == self.data.char for c in trace.last_reply[:4]) / 4


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for _ in range(self.config.num_tasks):
            char = chr(rng.randint(FIRST, LAST))
            yield EchoTask(EchoData(prompt=char * 4, char=char, answer=char * 4), self.config.task)
