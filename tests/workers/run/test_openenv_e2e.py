"""`rlbus run` on an OpenEnv text game (tests/workers/envs/openenv_games, OpenEnv's own server), spawned."""

import os

import pytest

from tests.paths import REPO
from tests.workers.run.test_session_e2e import (
    assert_counts_add_up,
    processes_mentioning,
    start_run,
    stdout_of,
    summary,
    wait_exit,
)

pytest.importorskip("openenv.core", reason="needs the openenv extra: pip install 'rlbus[openenv]'")

GAMES = REPO / "tests" / "workers" / "envs" / "openenv_games"

CONFIG = """
[run]
name = "oe"
seed = 0
[[env]]
name = "hotcold"
openenv = { app = "rlbus_test_hotcold:app", num_episodes = 256 }
group_size = 4
max_turns = 3
[sampling]
temperature = 1.0
max_completion_tokens = 2
[rollout]
max_concurrent_groups = 8
env_timeout_s = 60
[packer]
batch_size = 16
seq_len = 128
[trainer]
forward_batch = 8
lr = 5e-4
"""


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_an_openenv_game_trains_multi_turn(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(GAMES), str(REPO), os.environ.get("PYTHONPATH", "")]))
    config = tmp_path / "oe.toml"
    config.write_text(CONFIG)
    out = tmp_path / "run"
    others = set(processes_mentioning("rlbus_test_hotcold:app"))  # game servers that are not this run's
    proc = start_run(out, tiny_model_dir, "--run.max_steps", "2", config=config)
    assert wait_exit(proc, out, 380) == 0, stdout_of(out)[-4000:]
    s = summary(out)
    assert s["steps_trained"] == 2 and s["stopped_because"] == "max_steps"
    assert_counts_add_up(s["groups"])
    assert s["groups"]["trained"] > 0 and s["groups"]["dead_lettered"] == 0, s["groups"]
    assert not set(processes_mentioning("rlbus_test_hotcold:app")) - others, "the game server outlived the run"
