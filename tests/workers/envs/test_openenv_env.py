"""OpenEnv envs: a text game written here (``openenv_games/rlbus_test_hotcold``, openenv-core's own server) played
through :class:`OpenEnvHandle`, the calls the rollout worker makes for any multi-turn env."""

import asyncio
import os
import signal
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.paths import REPO
from workers.env_config import EnvConfig
from workers.envs.openenv_env import OpenEnvHandle

pytest.importorskip("openenv.core", reason="needs the openenv extra: pip install 'rlbus[openenv]'")

GAMES = Path(__file__).parent / "openenv_games"


@pytest.fixture(scope="module", autouse=True)
def games_installed():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(GAMES))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(GAMES), str(REPO), os.environ.get("PYTHONPATH", "")]))
        yield


def hotcold() -> EnvConfig:
    return EnvConfig(name="hotcold", openenv={"app": "rlbus_test_hotcold:app", "num_episodes": 50}, max_turns=3)


def test_config_forms():
    env = hotcold()
    assert env.kind == "openenv" and env.resolved_name == "hotcold"
    with pytest.raises(ValidationError, match="exactly one of app"):
        EnvConfig(openenv={"app": "a:app", "base_url": "http://x"})
    with pytest.raises(ValidationError, match="set only one"):
        EnvConfig(id="echo_chars", openenv={"app": "a:app"})


async def play(handle: OpenEnvHandle, index: int, guesses: list[str]) -> tuple[list[dict], dict, int]:
    """One episode the way GroupRunner plays it: initial, then a step after each model turn until done."""
    initial = await handle.initial(index)
    messages, state = list(initial["messages"]), dict(initial["state"])
    turns = 0
    for guess in guesses:
        messages.append({"role": "assistant", "content": guess})
        turns += 1
        reply = await handle.step(index, messages, state)
        state = reply["state"]
        if reply["done"]:
            break
        messages += reply["messages"]
    return messages, await handle.score(index, messages, state), turns


@pytest.mark.timeout(240)
async def test_episodes_are_multi_turn_seeded_and_rewarded_by_the_env():
    handle = await OpenEnvHandle.start(hotcold(), timeout_s=60)
    try:
        assert (await handle.info())["size"] == 50
        first = await handle.initial(7)
        assert "Hint" in first["messages"][0]["content"] and first["messages"][0]["role"] == "user"
        secret = first["messages"][0]["content"].split("near ")[1][0]
        # Two episodes of the same example at once, each in its own session: a miss then a hit, and three misses.
        (hit_msgs, hit, hit_turns), (_, miss, miss_turns) = await asyncio.gather(
            play(handle, 7, [chr(ord(secret) ^ 1), secret, secret]), play(handle, 7, [" ", " ", " ", " "]))
        assert hit_turns == 2 and hit_msgs[2]["content"] in ("higher", "lower")
        assert hit["reward"] >= 1.0 and hit["metrics"]["env_steps"] == 2
        assert miss_turns == 3 and miss["reward"] == 0.0  # the game ends after three guesses
        assert not handle.sessions, "every episode's session is closed"
        # A killed server is started again for the next episode.
        os.kill(handle.pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
        again = await handle.initial(7)
        assert again["messages"] == first["messages"] and handle.restarts == 1
    finally:
        await handle.close()
