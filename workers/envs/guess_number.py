"""``guess_number``: find a secret integer with "higher" / "lower" hints between turns (multi-turn).

Each model turn should contain a guess (the first integer in the reply counts). The env answers
"higher", "lower" or, when the reply holds no integer, how to answer; the episode ends when the
secret is found or after ``max_turns`` model turns.

Reward ``guess`` (partial credit):

- found on model turn ``t`` of at most ``T``: ``1 - 0.5 · (t - 1) / (T - 1)`` (1.0 at once, 0.5 on the last turn);
- not found: ``0.5 · (1 - |best guess - secret| / (high - low))``, below 0.5, rising as the closest guess nears
  the secret;
- no integer in any reply: 0.

Metrics ``found`` (0/1) and ``turns`` (model turns taken) have weight 0. The reward is computed from
the conversation alone, so a retried ``score`` call gives the same answer.
"""

import random
import re

from workers.envs.base import Environment, Example, Message, RewardFunc, Rubric, State, last_reply, replies

INTEGER = re.compile(r"-?\d+")

GUESS_LIMIT = 10**18
"""Guesses saturate at ±this: a reply of thousands of digits is a far miss, not a crash (``int`` refuses over 4300
digits, and a miss that large overflows a float)."""


def parse_guess(text: str) -> int | None:
    """The first integer in a reply (saturated at ±:data:`GUESS_LIMIT`), or None."""
    match = INTEGER.search(text)
    if match is None:
        return None
    digits = match.group().lstrip("-").lstrip("0") or "0"
    value = GUESS_LIMIT if len(digits) > len(str(GUESS_LIMIT)) else min(int(digits), GUESS_LIMIT)
    return -value if match.group().startswith("-") else value


class GuessNumber(Environment):
    """Multi-turn: replies with hints until the guess is right or the turns run out."""

    def __init__(self, dataset: list[Example], low: int, high: int, max_turns: int):
        self.low, self.high = low, high
        rubric = Rubric([
            RewardFunc(self._guess_reward, name="guess"),
            RewardFunc(self._found, weight=0.0, name="found"),
            RewardFunc(self._turns, weight=0.0, name="turns"),
        ])
        super().__init__("guess_number", dataset, self._prompt, rubric, max_turns=max_turns)

    def _prompt(self, example: Example) -> list[Message]:
        system = (
            f"Guess the secret integer between {self.low} and {self.high}. Reply with one number. "
            "After each wrong guess you are told whether the secret is higher or lower."
        )
        return [{"role": "system", "content": system}, {"role": "user", "content": "Your guess?"}]

    def respond(self, example: Example, messages: list[Message], state: State) -> tuple[list[Message], bool, State]:
        guess = parse_guess(last_reply(messages))
        secret = example["secret"]
        if guess == secret:
            return [], True, state
        if guess is None:
            hint = f"Reply with one integer between {self.low} and {self.high}."
        else:
            hint = "higher" if secret > guess else "lower"
        return [{"role": "user", "content": hint}], False, state

    def _guesses(self, messages: list[Message]) -> list[int | None]:
        return [parse_guess(text) for text in replies(messages)[: self.max_turns]]

    def _guess_reward(self, example: Example, messages: list[Message], state: State) -> float:
        guesses = self._guesses(messages)
        secret = example["secret"]
        if secret in guesses:
            turn = guesses.index(secret) + 1
            return 1.0 - 0.5 * (turn - 1) / max(1, self.max_turns - 1)
        numbers = [g for g in guesses if g is not None]
        if not numbers:
            return 0.0
        miss = min(min(abs(g - secret) for g in numbers), self.high - self.low)
        return 0.5 * (1.0 - miss / (self.high - self.low))

    def _found(self, example: Example, messages: list[Message], state: State) -> float:
        return float(example["secret"] in self._guesses(messages))

    def _turns(self, example: Example, messages: list[Message], state: State) -> float:
        guesses = self._guesses(messages)
        secret = example["secret"]
        return float(guesses.index(secret) + 1 if secret in guesses else len(guesses))


def load_environment(
    low: int = 1, high: int = 100, max_turns: int = 8, num_examples: int = 1000, seed: int = 0
) -> Environment:
    """Secrets drawn uniformly from [low, high] (seeded); at most ``max_turns`` guesses."""
    if high <= low:
        raise ValueError(f"need low < high, got low={low} high={high}")
    rng = random.Random(seed)
    dataset = [{"id": i, "secret": rng.randint(low, high)} for i in range(num_examples)]
    return GuessNumber(dataset, low, high, max_turns)
