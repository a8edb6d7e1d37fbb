"""An OpenEnv environment written for rlbus's tests: guess a printable character, told "higher" or "lower".

``reset(seed)`` picks the secret character (from the seed, so an episode reproduces); each action's ``message`` is a
guess (its first character counts); the reward of a step is the guess's closeness (``1 - distance / 12`` on the ring
of printable ASCII, floored at 0), the episode ends on a hit or after ``MAX_GUESSES``. Served by openenv-core's own
FastAPI app: ``uvicorn rlbus_test_hotcold:app``; ``capped_app`` is the same game on a server that holds at most
``CAPPED_SESSIONS`` sessions at once (as a hosted env would), refusing more.
"""

import random
import uuid

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

FIRST, LAST = 33, 126
RING = LAST - FIRST + 1
MAX_GUESSES = 3
CAPPED_SESSIONS = 2


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    message: str


class HotColdEnv(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.secret = "!"

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.secret = chr(random.Random(seed).randint(FIRST, LAST))
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return GuessObservation(message=f"Guess my character. Hint: it is near {self.secret * 3}.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        guess = action.message.strip()[:1] or " "
        d = abs(ord(guess) - ord(self.secret))
        reward = max(0.0, 1.0 - min(d, RING - d) / 12) if FIRST <= ord(guess) <= LAST else 0.0
        hit = guess == self.secret
        done = hit or self._state.step_count >= MAX_GUESSES
        hint = "correct" if hit else ("higher" if guess < self.secret else "lower")
        return GuessObservation(message=hint, reward=reward, done=done)

    @property
    def state(self) -> State:
        return self._state


app = create_app(HotColdEnv, GuessAction, GuessObservation, env_name="rlbus_test_hotcold", max_concurrent_envs=256)
capped_app = create_app(HotColdEnv, GuessAction, GuessObservation, env_name="rlbus_test_hotcold",
                        max_concurrent_envs=CAPPED_SESSIONS)
