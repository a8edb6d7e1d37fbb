"""OpenEnv envs: a text game written here (``openenv_games/rlbus_test_hotcold``, OpenEnv's own server) played
through :class:`OpenEnvHandle`, the calls the rollout worker makes for any multi-turn env."""

import asyncio
import os
import signal
from pathlib import Path

import pytest
from pydantic import ValidationError

from bus.messages import Task
from tests.paths import REPO
from workers.env_config import EnvConfig, SamplingConfig
from workers.envs.openenv_env import OpenEnvHandle
from workers.stages.episode import ChatTokens, GroupRunner
from workers.tools.init_model import build_tokenizer

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
    from workers.config import RlbusConfig

    with pytest.raises(ValidationError, match="OpenEnv env, which has no reference answers"):
        RlbusConfig.model_validate({"env": [{**env.model_dump(exclude_unset=True), "mode": "sft",
                                             "sft_source": "reference", "group_size": 1}]})


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


class MidwayClient:
    """An inference client that guesses " " (never a hit) on each episode's first turn, then fails (``fail``) or
    hangs (``hang``) on the next, or keeps guessing (``None``): an attempt that fails midway, its sessions open."""

    def __init__(self, chat: ChatTokens, then: str | None):
        self.chat, self.then, self.calls = chat, then, 0

    def pick_server(self):
        return 0

    async def completions(self, ids, *, n, **_):
        self.calls += 1
        if self.calls > 1 and self.then == "fail":
            raise RuntimeError("the inference server went away midway")
        if self.calls > 1 and self.then == "hang":
            await asyncio.sleep(3600)
        ids = self.chat.tokenizer.encode(" ", add_special_tokens=False) + [self.chat.end_id]
        choice = type("Choice", (), {"token_ids": ids, "logprobs": [-0.1] * len(ids), "finish_reason": "stop"})
        return type("Result", (), {"choices": [choice] * n, "policy_version": 0})


async def test_a_failed_attempts_sessions_are_closed_so_a_capped_server_takes_the_next_episodes():
    from rlbus_test_hotcold import CAPPED_SESSIONS

    env = EnvConfig(name="capped", openenv={"app": "rlbus_test_hotcold:capped_app", "num_episodes": 50}, max_turns=3)
    handle = await OpenEnvHandle.start(env, timeout_s=30)
    chat = ChatTokens(build_tokenizer())
    sampling = SamplingConfig(temperature=1.0, max_completion_tokens=4)

    def attempt(then: str | None, index: int):
        task = Task(task_id=f"t:{index}", env="capped", example_id=str(index), example_index=index, epoch=0,
                    group_size=CAPPED_SESSIONS, mode="rl")
        runner = GroupRunner(chat, MidwayClient(chat, then), None, max_model_len=512, fallback_version=lambda: 0)
        return runner.run(task, handle, sampling, max_turns=3)

    try:
        for index in range(3):  # each attempt opens every session the server holds, then fails with them open
            with pytest.raises(RuntimeError, match="went away midway"):
                await attempt("fail", index)
            assert not handle.sessions
        with pytest.raises(TimeoutError):  # the rollout's timeout cancels an attempt midway
            async with asyncio.timeout(5):
                await attempt("hang", 3)
        assert not handle.sessions
        samples, _ = await attempt(None, 4)  # the server has room for a whole group again
        assert len(samples) == CAPPED_SESSIONS and all(s.turns == 3 for s in samples)
    finally:
        await handle.close()
