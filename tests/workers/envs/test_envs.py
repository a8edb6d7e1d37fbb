"""Environments: datasets, prompts, hand-checked rewards (partial and full credit), multi-turn steps, loading."""

import pytest

from bus.errors import ConfigError
from workers.envs import BUILTIN, Environment, RewardFunc, Rubric, load_env
from workers.envs.echo_chars import char_credit
from workers.envs.guess_number import parse_guess


def required_args(env_id: str) -> list[str]:
    import importlib
    import inspect

    module, _, name = BUILTIN[env_id].partition(":")
    params = inspect.signature(getattr(importlib.import_module(module), name)).parameters.values()
    return [p.name for p in params if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD]


def answered(env: Environment, index: int, *replies_and_hints: str) -> list[dict]:
    """The prompt of ``index`` followed by alternating assistant replies and user hints."""
    messages = list(env.initial(index)["messages"])
    for i, text in enumerate(replies_and_hints):
        messages.append({"role": "assistant" if i % 2 == 0 else "user", "content": text})
    return messages


SELF_CONTAINED = [env_id for env_id in sorted(BUILTIN) if not required_args(env_id)]
"""The built-ins that need no arguments (``dataset`` needs a file, ``reasoning_gym`` a task name)."""


@pytest.mark.parametrize("env_id", SELF_CONTAINED)
def test_builtins_load_with_seeded_datasets(env_id):
    env = load_env(env_id)
    assert len(env) >= 1000
    info = env.info()
    assert info["name"] == env_id and info["size"] == len(env) and info["reward_names"]
    assert load_env(env_id).example(7) == env.example(7)  # deterministic
    assert [load_env(env_id, {"seed": 1}).example(i) for i in range(5)] != [env.example(i) for i in range(5)]
    first = env.initial(0)
    assert first["messages"][-1]["role"] == "user" and first["state"] == {"turn": 0}
    with pytest.raises(IndexError, match=f"out of range for env '{env_id}'"):
        env.example(len(env))


def test_reverse_text_lcs_ratio():
    env = load_env("reverse_text", {"num_examples": 10})
    example = env.example(0)
    answer = example["text"][::-1]
    assert env.score(0, answered(env, 0, f" {answer}\n"), {})["reward"] == 1.0
    half = env.score(0, answered(env, 0, answer[: len(answer) // 2]), {})["reward"]
    expected = 2 * (len(answer) // 2) / (len(answer) + len(answer) // 2)  # SequenceMatcher: 2·M / total length
    assert half == pytest.approx(expected)
    assert env.score(0, answered(env, 0, ""), {}) == {"reward": 0.0, "metrics": {"lcs_ratio": 0.0}}
    assert env.step(0, answered(env, 0, answer), {"turn": 0}) == {"messages": [], "done": True, "state": {"turn": 1}}


def test_echo_chars_credit_by_hand():
    assert char_credit("k", "k", 12) == 1.0
    assert char_credit("l", "k", 12) == pytest.approx(11 / 12)
    assert char_credit("e", "kq", 12) == pytest.approx(6 / 12)  # nearest prompt char counts
    assert char_credit("~", "!", 12) == pytest.approx(11 / 12)  # the ring wraps
    assert char_credit("w", "k", 12) == 0.0  # 12 steps away
    assert char_credit(" ", " ", 12) == 0.0 and char_credit("é", "k", 12) == 0.0


def test_echo_chars_rewards_partial_and_full():
    env = load_env("echo_chars", {"num_examples": 50, "answer_len": 4})
    index = next(i for i in range(50) if len(env.example(i)["chars"]) == 2)
    a, b = env.example(index)["chars"]
    score = lambda text: env.score(index, answered(env, index, text), {})  # noqa: E731
    assert score(a + b + a + b + "junk") == {"reward": 1.0, "metrics": {"closeness": 1.0, "exact": 1.0}}
    assert score(a * 3) == {"reward": 0.75, "metrics": {"closeness": 0.75, "exact": 0.75}}  # 3 of 4 counted chars
    assert score("    ")["reward"] == 0.0
    near = chr(33 + (ord(a) - 33 + 3) % 94)  # three ring steps from a
    expected = max(char_credit(near, a + b, 12.0), 0.0)
    assert score(near * 4)["reward"] == pytest.approx(expected) and expected >= 0.75
    assert score(near * 4)["metrics"]["exact"] == (1.0 if near in (a, b) else 0.0)


def test_echo_chars_rewards_depend_on_the_prompt():
    """No constant answer comes close to echoing; a uniform random sampler scores clearly above 0."""
    env = load_env("echo_chars", {"num_examples": 400})
    examples = [env.example(i) for i in range(400)]
    best_constant = max(
        sum(char_credit(chr(c), ex["chars"], 12.0) for ex in examples) / len(examples) for c in range(33, 127)
    )
    # A random-init model samples ~uniformly over 259 tokens; only printable ASCII can earn credit.
    uniform = sum(char_credit(chr(c), ex["chars"], 12.0) for ex in examples for c in range(33, 127)) / (
        259 * len(examples)
    )
    assert best_constant < 0.3
    assert 0.04 < uniform < 0.1
    lengths = {len(ex["text"]) for ex in examples}
    assert min(lengths) >= 3 and max(lengths) <= 6
    assert all(set(ex["text"]) == set(ex["chars"]) for ex in examples)


def test_guess_number_steps_and_rewards():
    env = load_env("guess_number", {"low": 1, "high": 100, "max_turns": 4})
    secret = env.example(0)["secret"]
    low_guess, high_guess = max(1, secret - 10), min(100, secret + 10)
    state = env.initial(0)["state"]
    messages = answered(env, 0, f"I think {low_guess}")
    out = env.step(0, messages, state)
    if low_guess != secret:
        assert out["done"] is False and out["messages"] == [{"role": "user", "content": "higher"}]
    out = env.step(0, answered(env, 0, str(low_guess), "higher", str(high_guess)), out["state"])
    if high_guess != secret:
        assert out["messages"] == [{"role": "user", "content": "lower"}]
    out = env.step(0, answered(env, 0, "no idea"), {"turn": 0})
    assert "Reply with one integer" in out["messages"][0]["content"]
    assert env.step(0, answered(env, 0, str(secret)), {"turn": 0})["done"] is True
    last = env.step(0, answered(env, 0, "x", "h", "x", "h", "x", "h", "x"), {"turn": 3})
    assert last == {"messages": [], "done": True, "state": {"turn": 4}}  # max_turns reached

    full = env.score(0, answered(env, 0, str(secret)), {})
    assert full == {"reward": 1.0, "metrics": {"guess": 1.0, "found": 1.0, "turns": 1.0}}
    third = env.score(0, answered(env, 0, "0", "higher", "x", "h", f"= {secret}"), {})
    assert third["reward"] == pytest.approx(1.0 - 0.5 * 2 / 3) and third["metrics"]["turns"] == 3.0
    miss = 200 if secret < 50 else -100
    near = env.score(0, answered(env, 0, str(secret + 9 if secret <= 91 else secret - 9), "h", str(miss)), {})
    assert near["reward"] == pytest.approx(0.5 * (1 - 9 / 99)) and near["metrics"]["found"] == 0.0
    assert env.score(0, answered(env, 0, "dunno"), {})["reward"] == 0.0
    assert parse_guess("maybe -3 or 4") == -3 and parse_guess("none") is None


def test_guess_number_scores_a_reply_of_thousands_of_digits_as_a_far_miss():
    """A sampled reply can be one long run of digits (an eval with no token limit generated one): scoring it
    raised (int() refuses over 4300 digits; a miss of 10**400 overflows a float), every attempt of the task failed,
    and the eval waited on dead letters."""
    env = load_env("guess_number", {"low": 1, "high": 100, "max_turns": 4})
    for reply in ("9" * 5000, "-" + "7" * 400):
        assert env.score(0, answered(env, 0, reply), {})["reward"] == 0.0
    assert parse_guess("9" * 5000) == 10**18 and parse_guess("-" + "7" * 400) == -(10**18)
    assert parse_guess("0" * 6000 + "5") == 5
    out = env.step(0, answered(env, 0, "9" * 5000), {"turn": 0})
    assert out["messages"] == [{"role": "user", "content": "lower"}]


def test_rubric_weights_and_metric_only_functions():
    def one(example, messages, state):
        return 1.0

    def half(example, messages, state):
        return 0.5

    rubric = Rubric([RewardFunc(one, weight=0.2), RewardFunc(half, weight=2.0), RewardFunc(one, 0.0, name="m")])
    assert rubric.score({}, [], {}) == {"reward": pytest.approx(1.2), "metrics": {"one": 1.0, "half": 0.5, "m": 1.0}}
    with pytest.raises(ValueError, match="unique"):
        Rubric([RewardFunc(one), RewardFunc(one)])


def test_import_path_env_with_kwargs(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(
        "from workers.envs import Environment, RewardFunc, Rubric, last_reply\n"
        "def make(n=3, word='hi'):\n"
        "    def said(example, messages, state):\n"
        "        return float(last_reply(messages) == example['word'])\n"
        "    return Environment('said', [{'word': word}] * n,\n"
        "                       lambda ex: [{'role': 'user', 'content': 'say ' + ex['word']}],\n"
        "                       Rubric([RewardFunc(said)]))\n"
        "not_a_factory = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_env("my_envs:make", {"n": 5, "word": "yo"})
    assert len(env) == 5 and env.initial(0)["messages"] == [{"role": "user", "content": "say yo"}]
    assert env.score(0, [{"role": "assistant", "content": "yo"}], {})["reward"] == 1.0
    with pytest.raises(ConfigError, match="do not fit"):
        load_env("my_envs:make", {"bogus": 1})
    with pytest.raises(ConfigError, match="no callable 'not_a_factory'"):
        load_env("my_envs:not_a_factory")
    with pytest.raises(ConfigError, match="cannot import 'missing_mod'"):
        load_env("missing_mod:make")
    with pytest.raises(ConfigError, match="unknown env id 'sort_things'"):
        load_env("sort_things")
    with pytest.raises(ConfigError, match="min_len"):
        load_env("echo_chars", {"min_len": 5, "max_len": 2})
