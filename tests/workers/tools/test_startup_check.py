"""What would stop ``rlbus run``, found without starting it: one line per problem, every bad env named."""

from workers.tools.startup_check import startup_problems


def test_a_config_that_would_start_has_no_problems():
    assert startup_problems({"env": [{"id": "reverse_text"}], "eval": {"env": [{"id": "echo_chars"}]}}) == []


def test_no_env_and_every_unknown_env_are_named():
    assert startup_problems({}) == [
        "no [[env]] configured; a run needs at least one training env (an [[env]] with an id)"]
    problems = startup_problems({"env": [{"id": "reverse_text"}, {"id": "nope-a"}],
                                 "eval": {"env": [{"id": "nope-b"}]}})
    assert [p.split(":")[0] for p in problems] == ["env.1 ('nope-a')", "eval.env.0 ('nope-b')"]
    assert "unknown env id 'nope-a'" in problems[0]


def test_the_config_models_own_checks_come_one_line_per_env():
    problems = startup_problems({"env": [{"id": "reverse_text", "mode": "opd"}]})
    assert problems == ["the config: env 'reverse_text' has mode='opd', which needs a [teacher] section"]
    problems = startup_problems({"env": [{"taskset": {"id": "x"}}]})
    assert len(problems) == 1 and problems[0].startswith("env.0 ('x')") and "taskset 'x' not found" in problems[0]
