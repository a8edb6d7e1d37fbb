"""An OpenEnv environment written for rlbus's tests: guess a printable character, told "higher" or "lower".

``reset(seed, max_guesses=3)`` picks the secret character (from the seed, so an episode reproduces); each action's
``message`` is a guess (its first character counts; a message that is not a string counts as its JSON text); the
reward of a step is the guess's closeness (``1 - distance / 12`` on the ring of printable ASCII, floored at 0), the
episode ends on a hit or after ``max_guesses``. Served by OpenEnv's own FastAPI app: ``uvicorn rlbus_test_hotcold:app``;
``capped_app`` is the same game on a server that holds at most ``CAPPED_SESSIONS`` sessions at once (as a hosted env
would), refusing more.
"""

import json
import random
import uuid
from typing import Any

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import field_validator

FIRST, LAST = 33, 126
RING = LAST - FIRST + 1
MAX_GUESSES = 3
CAPPED_SESSIONS = 2


class GuessAction(Action):
    message: str

    @field_validator("message", mode="before")
    @classmethod
    def as_text(cls, value: Any) -> str:
        """A reply parsed as JSON (``7``, ``[]``: verifiers' openenv taskset parses replies) is guessed as its text."""
        return value if isinstance(value, str) else json.dumps(value)


class GuessObservation(Observation):
    message: str


class HotColdEnv(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.secret = "!"
        self.max_guesses = MAX_GUESSES

    def reset(self, seed=None, episode_id=None, max_guesses=MAX_GUESSES, **kwargs) -> GuessObservation:
        self.max_guesses = max_guesses
        self.secret = chr(random.Random(seed).randint(FIRST, LAST))
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return GuessObservation(message=f"Guess my character. Hint: it is near {self.secret * 3}.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        guess = action.message.strip()[:1] or " "
        d = abs(ord(guess) - ord(self.secret))
        reward = max(0.0, 1.0 - min(d, RING - d) / 12) if FIRST <= ord(guess) <= LAST else 0.0
        hit = guess == self.secret
        done = hit or self._state.step_count >= self.max_guesses
        hint = "correct" if hit else ("higher" if guess < self.secret else "lower")
        return GuessObservation(message=hint, reward=reward, done=done)

    @property
    def state(self) -> State:
        return self._state


app = create_app(HotColdEnv, GuessAction, GuessObservation, env_name="rlbus_test_hotcold", max_concurrent_envs=256)
capped_app = create_app(HotColdEnv, GuessAction, GuessObservation, env_name="rlbus_test_hotcold",
                        max_concurrent_envs=CAPPED_SESSIONS)
