"""What an environment is: a dataset, a prompt per example, a rubric, and (multi-turn) replies between turns.

An env server (``workers/envs/server.py``) serves one :class:`Environment` over ZeroMQ; everything
that crosses the wire (examples, messages, state) is plain msgpack-able data. Chat messages are
``{"role": ..., "content": ...}`` dicts; ``messages`` passed to :meth:`Environment.step` and
:meth:`Environment.score` is the whole conversation so far (the prompt, every model turn, every env reply).

Write your own by subclassing nothing at all::

    def load_environment(n: int = 100) -> Environment:
        data = [{"question": f"{i}+{i}=", "answer": str(2 * i)} for i in range(n)]
        def correct(example, messages, state):
            return float(last_reply(messages).strip() == example["answer"])
        return Environment("doubling", data, lambda ex: [{"role": "user", "content": ex["question"]}],
                           Rubric([RewardFunc(correct)]))

and point the config at it: ``[[env]] id = "my_pkg.my_env:load_environment"  args = {n = 500}``.
Multi-turn envs subclass :class:`Environment` and override :meth:`Environment.respond`. An env whose examples
carry a reference answer passes ``reference=lambda ex: ex["answer"]``: ``mode = "sft"`` with
``sft_source = "reference"`` then trains on prompt + reference, no teacher needed.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, str]
Example = dict[str, Any]
State = dict[str, Any]
RewardFn = Callable[[Example, list[Message], State], float]
"""A reward function: ``fn(example, messages, state) -> float`` (messages = the whole conversation)."""


def last_reply(messages: Sequence[Message]) -> str:
    """Content of the last assistant message ('' if the model has not spoken)."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return message.get("content") or ""
    return ""


def replies(messages: Sequence[Message]) -> list[str]:
    """Contents of every assistant message, in order."""
    return [m.get("content") or "" for m in messages if m.get("role") == "assistant"]


@dataclass(frozen=True)
class RewardFunc:
    """One reward function of a rubric; its value is reported as metric ``name`` and weighted into the reward."""

    fn: RewardFn
    weight: float = 1.0
    name: str | None = None

    @property
    def metric(self) -> str:
        return self.name or self.fn.__name__


class Rubric:
    """Weighted reward functions: reward = Σ weight·fn; each fn's value is also a metric (weight 0 = metric only)."""

    def __init__(self, funcs: Sequence[RewardFunc]):
        if not funcs:
            raise ValueError("a rubric needs at least one reward function")
        names = [f.metric for f in funcs]
        if len(set(names)) != len(names):
            raise ValueError(f"reward function names must be unique, got {names}; pass name=... to RewardFunc")
        self.funcs = list(funcs)

    @property
    def names(self) -> list[str]:
        return [f.metric for f in self.funcs]

    def score(self, example: Example, messages: list[Message], state: State) -> dict[str, Any]:
        """``{"reward": Σ weight·value, "metrics": {name: value}}``."""
        metrics = {f.metric: float(f.fn(example, messages, state)) for f in self.funcs}
        reward = sum(f.weight * metrics[f.metric] for f in self.funcs)
        return {"reward": float(reward), "metrics": metrics}


class Environment:
    """A dataset of examples, how an example becomes chat messages, and a rubric.

    Single-turn by default (``max_turns = 1``: :meth:`step` says done after the model's answer).
    Multi-turn envs override :meth:`respond` and pass ``max_turns > 1``; the env server lowers
    ``max_turns`` to the config's ``[[env]] max_turns`` when that is smaller.
    """

    def __init__(
        self,
        name: str,
        dataset: Sequence[Example],
        prompt: Callable[[Example], list[Message]],
        rubric: Rubric,
        max_turns: int = 1,
        reference: Callable[[Example], str] | None = None,
    ):
        if not dataset:
            raise ValueError(f"env {name!r} has an empty dataset")
        if max_turns < 1:
            raise ValueError(f"env {name!r}: max_turns={max_turns} must be at least 1")
        self.name = name
        self.dataset = dataset
        self.prompt = prompt
        self.rubric = rubric
        self.max_turns = max_turns
        self.reference_fn = reference
        """The reference answer of an example (the assistant's text), for sft from data; None: the env has none."""

    def __len__(self) -> int:
        return len(self.dataset)

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "size": len(self), "max_turns": self.max_turns, "reward_names": self.rubric.names,
                "has_reference": self.reference_fn is not None}

    def example(self, index: int) -> Example:
        if not 0 <= index < len(self.dataset):
            raise IndexError(f"index {index} is out of range for env {self.name!r} with {len(self)} examples")
        return self.dataset[index]

    def reference(self, index: int) -> str:
        """The reference answer of example ``index`` (what sft from data trains the model to say)."""
        if self.reference_fn is None:
            raise ValueError(f"env {self.name!r} has no reference answers; use sft_source = \"teacher\" or an env "
                             "whose examples carry one (the dataset env's answer_field)")
        return str(self.reference_fn(self.example(index)))

    def initial(self, index: int) -> dict[str, Any]:
        """The prompt messages of example ``index`` and the episode's starting state."""
        return {"messages": self.prompt(self.example(index)), "state": {"turn": 0}}

    def step(self, index: int, messages: list[Message], state: State) -> dict[str, Any]:
        """After a model turn: the env's reply messages, whether the episode is over, and the new state."""
        state = {**state, "turn": int(state.get("turn", 0)) + 1}
        if self.max_turns == 1:
            return {"messages": [], "done": True, "state": state}
        reply, done, state = self.respond(self.example(index), messages, state)
        done = done or state["turn"] >= self.max_turns
        return {"messages": [] if done else reply, "done": done, "state": state}

    def respond(self, example: Example, messages: list[Message], state: State) -> tuple[list[Message], bool, State]:
        """Multi-turn envs: ``(reply messages, done, state)`` after the model's latest turn."""
        raise NotImplementedError(f"env {self.name!r} has max_turns={self.max_turns} but does not override respond()")

    def score(self, index: int, messages: list[Message], state: State) -> dict[str, Any]:
        """Reward and per-function metrics of a finished episode."""
        return self.rubric.score(self.example(index), messages, state)
