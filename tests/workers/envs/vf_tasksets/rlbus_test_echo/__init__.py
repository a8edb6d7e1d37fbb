"""A verifiers v1 taskset written for rlbus's tests (``taskset = { id = "rlbus-test-echo" }``): say a given letter.

Single-turn: the prompt asks for one letter; reward 1 when the reply's first character is it. Learnable by the tiny
random model within a few steps, like rlbus's own echo_chars.
"""

import verifiers.v1 as vf

__all__ = ["EchoTaskset"]

LETTERS = "abcdefgh"


class EchoConfig(vf.TasksetConfig):
    num_tasks: int = 64
    """Tasks in the taskset."""


class EchoData(vf.TaskData):
    letter: str


class EchoTask(vf.Task[EchoData]):
    @vf.reward
    async def first_letter(self, trace) -> float:
        return float(trace.last_reply.strip()[:1] == self.data.letter)

    @vf.metric
    async def reply_chars(self, trace) -> float:
        return float(len(trace.last_reply))


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            letter = LETTERS[i % len(LETTERS)]
            yield EchoTask(EchoData(prompt=f"Say {letter}", letter=letter), self.config.task)
