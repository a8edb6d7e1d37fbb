"""Envs from outside: the dataset env over local JSONL / Parquet / CSV files, and reasoning-gym's generators."""

import json

import pytest

from bus.errors import ConfigError
from tests.paths import REPO
from workers.envs.registry import load_env


def episode(env, index: int, reply: str) -> float:
    messages = env.initial(index)["messages"] + [{"role": "assistant", "content": reply}]
    return env.score(index, messages, {"turn": 1})["reward"]


@pytest.fixture
def rows():
    return [{"question": f"What is {i} + {i}?", "answer": str(2 * i), "level": i % 3} for i in range(6)]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet", "csv"])
def test_a_local_file_in_any_of_three_formats_is_an_env(tmp_path, rows, suffix):
    import pandas as pd

    path = tmp_path / f"train.{suffix}"
    frame = pd.DataFrame(rows)
    if suffix == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    elif suffix == "parquet":
        frame.to_parquet(path)
    else:
        frame.to_csv(path, index=False)
    env = load_env("dataset", {"path": str(path), "prompt_field": "question", "system_prompt": "Answer briefly."})
    assert len(env) == 6 and env.info()["has_reference"]
    assert env.initial(2)["messages"] == [{"role": "system", "content": "Answer briefly."},
                                          {"role": "user", "content": "What is 2 + 2?"}]
    assert env.reference(3) == "6"
    assert episode(env, 3, " 6 ") == 1.0 and episode(env, 3, "7") == 0.0


def test_rewards_messages_and_a_bad_field_that_lists_the_columns(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "user", "content": "Half of one?"}], "answer": "\\frac{1}{2}"},
        {"messages": [{"role": "user", "content": "Reverse abc"}], "answer": "cba"},
    ]))
    math = load_env("dataset", {"path": str(path), "messages_field": "messages", "reward": "math"})
    assert math.initial(0)["messages"] == [{"role": "user", "content": "Half of one?"}]
    assert episode(math, 0, "It is $0.5$") == 1.0 and episode(math, 0, "It is $0.4$") == 0.0
    lcs = load_env("dataset", {"path": str(path), "messages_field": "messages", "reward": "lcs"})
    assert episode(lcs, 1, "cba") == 1.0 and 0.0 < episode(lcs, 1, "cbx") < 1.0
    with pytest.raises(ConfigError, match=r"has no field 'question'; its columns are \['answer', 'messages'\]"):
        load_env("dataset", {"path": str(path), "prompt_field": "question"})
    with pytest.raises(ConfigError, match="does not exist"):
        load_env("dataset", {"path": str(tmp_path / "missing.jsonl")})
    with pytest.raises(ConfigError, match=r"reward='fuzzy'; use one of \['exact', 'lcs', 'math'\]"):
        load_env("dataset", {"path": str(path), "reward": "fuzzy"})


@pytest.mark.parametrize("task", ["spell_backward", "basic_arithmetic", "letter_counting"])
def test_reasoning_gym_tasks_are_generated_offline_and_scored_by_their_own_scorer(task):
    env = load_env("reasoning_gym", {"dataset": task, "size": 20, "seed": 3})
    again = load_env("reasoning_gym", {"dataset": task, "size": 20, "seed": 3})
    assert len(env) == 20 and env.initial(5) == again.initial(5)  # the same examples from the same seed
    for index in range(3):
        assert episode(env, index, env.reference(index)) == 1.0
        assert episode(env, index, "zzz") == 0.0
    with pytest.raises(ConfigError, match="reasoning-gym cannot build 'no_such_task'"):
        load_env("reasoning_gym", {"dataset": "no_such_task"})


def test_a_held_out_split_never_shares_an_answer_with_training_whatever_the_seeds():
    args = {"dataset": "spell_backward", "size": 400, "max_word_len": 4, "holdout": 0.2}
    train = load_env("reasoning_gym", {**args, "seed": 0})
    test = load_env("reasoning_gym", {**args, "seed": 1, "split": "held_out"})
    answers = lambda env: {env.reference(i) for i in range(len(env))}  # noqa: E731
    assert 250 < len(train) < 380 and 40 < len(test) < 130  # ~80% / ~20% of 400
    assert not answers(train) & answers(test)
    with pytest.raises(ConfigError, match="holdout=1.5"):
        load_env("reasoning_gym", {**args, "holdout": 1.5})
    with pytest.raises(ConfigError, match="split='held_out' needs holdout > 0"):
        load_env("reasoning_gym", {**args, "holdout": 0, "split": "held_out"})


def test_the_quick_starts_task_gives_trivial_policies_at_most_a_quarter():
    from workers.config_loader import load_config

    env_cfg = load_config([REPO / "configs" / "quickstart.toml"]).stage[1].config.env[0]
    env = load_env(env_cfg.id, env_cfg.args)
    answered = lambda text: sum(episode(env, i, text(env.example(i))) for i in range(500)) / 500  # noqa: E731
    assert answered(lambda example: example["metadata"]["word"]) <= 0.25  # copying the word
    for constant in ("", "e", "s", "es", "seta", "eeeeee"):
        assert answered(lambda example, c=constant: c) <= 0.25
    assert answered(lambda example: example["answer"]) == 1.0


def test_csv_answers_stay_text_long_answers_score_fairly_and_empty_answers_are_refused(tmp_path):
    path = tmp_path / "codes.csv"
    path.write_text("prompt,answer\nfirst,007\nsecond,1e3\n")
    env = load_env("dataset", {"path": str(path)})
    assert [env.reference(i) for i in range(2)] == ["007", "1e3"]
    long = tmp_path / "long.jsonl"
    answer = "abcdefghij" * 40
    long.write_text(json.dumps({"prompt": "p", "answer": answer}) + "\n")
    lcs = load_env("dataset", {"path": str(long), "reward": "lcs"})
    assert episode(lcs, 0, answer[:-1] + "X") > 0.99  # one wrong character in 400
    empty = tmp_path / "empty.csv"
    empty.write_text("prompt,answer\nfirst,\nsecond,2\n")
    with pytest.raises(ConfigError, match=r"rows \[0\] have no 'answer'"):
        load_env("dataset", {"path": str(empty)})
