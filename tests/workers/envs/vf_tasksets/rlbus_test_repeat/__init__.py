"""A multi-turn verifiers v1 taskset for rlbus's tests (``taskset = { id = "rlbus-test-repeat" }``).

The env plays the user: it asks for a letter, then after each model turn asks again (``turns`` model turns in all).
Reward: the share of model turns whose reply starts with the letter. Its own ``Env`` (as verifiers' TextArena
taskset has), so the trace carries env replies between model turns: they must come out of the loss mask.
"""

import verifiers.v1 as vf

__all__ = ["RepeatEnv", "RepeatTaskset"]

LETTERS = "abcdefgh"


class RepeatConfig(vf.TasksetConfig):
    num_tasks: int = 32
    """Tasks in the taskset."""
    turns: int = 2
    """Model turns per episode."""


class RepeatData(vf.TaskData):
    letter: str
    turns: int


class RepeatTask(vf.Task[RepeatData]):
    pass


class RepeatTaskset(vf.Taskset[RepeatTask, RepeatConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            letter = LETTERS[i % len(LETTERS)]
            data = RepeatData(prompt=f"Say {letter}", letter=letter, turns=self.config.turns)
            yield RepeatTask(data, self.config.task)


class RepeatEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class RepeatEnv(vf.Env[RepeatEnvConfig]):
    async def run(self, task, agents):
        hits = 0
        async with agents.agent.interaction(task) as interaction:
            segment = await interaction.turn()
            for turn in range(task.data.turns):
                hits += segment.last_reply.strip()[:1] == task.data.letter
                if segment.terminated or turn + 1 == task.data.turns:
                    break
                segment = await interaction.turn(f"Again: say {task.data.letter}")
        interaction.trace.record_reward("hits", hits / task.data.turns, 1.0)
