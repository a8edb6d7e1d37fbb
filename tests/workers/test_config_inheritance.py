"""The seeds' config semantics: defaults per filter slot, field-by-field inheritance of per-env settings,
group-level defaults, eval knobs that defer to the server, validators, aliases, bench mode."""

import warnings

import pytest

from bus.errors import ConfigError
from tests.paths import REPO
from workers.config_loader import load_config, split_argv
from workers.inference.client import InferenceClient
from workers.run.resolved import dump_toml


def test_zero_advantage_enforces_after_the_batch_and_only_watches_before():
    config = load_config([], [])
    post = {f.type: f.enforce for f in config.packer.post_batch_filters}
    pre = {f.type: f.enforce for f in config.filter.pre_batch_filters}
    assert post == {"gibberish": False, "repetition": False, "zero_advantage": True}
    assert pre == {"gibberish": False, "repetition": False, "zero_advantage": False}


def test_per_env_sampling_and_advantage_inherit_field_by_field(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('''
[sampling]
max_completion_tokens = 4
temperature = 0.9

[filter.advantage]
length_penalty = 0.1

[[env]]
id = "reverse_text"
sampling = { temperature = 0.7 }
advantage = { std_normalize = true }

[[env]]
id = "echo_chars"

[eval.sampling]
max_completion_tokens = 6

[[eval.env]]
id = "echo_chars"
sampling = { temperature = 0.0 }
''')
    config = load_config([path])
    own, shared = config.env
    assert (own.sampling.temperature, own.sampling.max_completion_tokens) == (0.7, 4)
    assert (shared.sampling.temperature, shared.sampling.max_completion_tokens) == (0.9, 4)
    assert (own.advantage.std_normalize, own.advantage.length_penalty) == (True, 0.1)
    assert (shared.advantage.std_normalize, shared.advantage.length_penalty) == (False, 0.1)
    ev = config.eval.env[0].sampling
    assert (ev.temperature, ev.max_completion_tokens, ev.top_p) == (0.0, 6, None)
    # a worker reading config.resolved.toml sees the same effective values
    again = tmp_path / "resolved.toml"
    again.write_text(dump_toml(config.model_dump(mode="json")))
    assert load_config([again]).model_dump() == config.model_dump()


def test_group_level_defaults_that_envs_inherit(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('''
rollouts_per_example = 4
max_retries = 1
training_mode = "sft"

[teacher]
path = "somewhere"

[[env]]
id = "reverse_text"

[[env]]
id = "echo_chars"
group_size = 2
max_retries = 5
mode = "rl"

[eval]
num_examples = 16
group_size = 2
max_retries = 0

[[eval.env]]
id = "echo_chars"

[[eval.env]]
id = "reverse_text"
interval = 7
num_examples = 3
''')
    config = load_config([path], [("packer.batch_size", "8")])
    first, second = config.env
    assert (first.group_size, first.max_retries, first.mode) == (4, 1, "sft")
    assert (second.group_size, second.max_retries, second.mode) == (2, 5, "rl")
    inherits, overrides = config.eval.env
    assert (inherits.interval, inherits.num_examples, inherits.group_size, inherits.max_retries) == (100, 16, 2, 0)
    assert (overrides.interval, overrides.num_examples) == (7, 3)
    files, flags, _, _ = split_argv(["--group-size", "2", "--training_mode", "rl", "--env.0.id", "echo_chars"])
    assert [(e.group_size, e.mode) for e in load_config(files, flags).env] == [(2, "rl")]


async def test_eval_sampling_defers_to_the_server_unless_set():
    config = load_config([], [("eval.env.0.id", "echo_chars")])
    sampling = config.eval_sampling(config.eval.env[0])
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (None, None, None, None)
    assert sampling.max_completion_tokens is None and sampling.reasoning_effort is None
    sent = []
    client = InferenceClient(["http://127.0.0.1:9/v1"])

    async def post(path, body, index):
        sent.append(body)
        raise LookupError("captured")

    async def model_name(index):
        return "m"

    client.post, client._model_name = post, model_name
    with pytest.raises(LookupError):
        await client.completions([1, 2], temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=5,
                                 reasoning_effort="low")
    assert {"temperature", "top_p", "top_k", "min_p"}.isdisjoint(sent[0]) and sent[0]["reasoning_effort"] == "low"
    with pytest.raises(ConfigError, match="reasoning_effort"):
        load_config([], [("eval.sampling.reasoning_effort", "extreme")])


def test_validators_of_the_seeds():
    with pytest.raises(ConfigError, match=r"duplicate eval env names \['echo_chars'\]"):
        load_config([], [("eval.env.0.id", "echo_chars"), ("eval.env.1.id", "echo_chars")])
    with pytest.raises(ConfigError, match="max_inflight_rollouts=100 conflicts with feeder.oversampling_factor=2.0"):
        load_config([], [("packer.batch_size", "16"), ("feeder.oversampling_factor", "2.0"),
                         ("feeder.max_inflight_rollouts", "100")])
    assert load_config([], [("packer.batch_size", "16"), ("feeder.oversampling_factor", "2.0"),
                            ("feeder.max_inflight_rollouts", "32")]).max_inflight_rollouts() == 32
    with pytest.raises(ConfigError, match="num_workers=4 was removed.*rollout.workers"):
        load_config([], [("env.0.id", "echo_chars"), ("env.0.num_workers", "4")])
    with pytest.warns(FutureWarning, match="num_workers"):
        assert load_config([], [("env.0.id", "echo_chars"), ("env.0.num_workers", "auto")]).env[0].id == "echo_chars"


def test_training_mode_section_names_of_the_pr_are_aliases(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[student]\npath = "a"\n\n[teacher_model]\npath = "b"\n')
    with pytest.warns(FutureWarning) as caught:
        config = load_config([path])
    assert sorted(str(w.message).split(" is ")[0] for w in caught) == ["[student]", "[teacher_model]"]
    assert "use [model]" in str(caught[0].message) + str(caught[1].message)
    assert (config.model.path, config.teacher.path) == ("a", "b")
    path.write_text('[student]\npath = "a"\n\n[model]\npath = "b"\n')
    with pytest.raises(ConfigError, match=r"\[student\] and \[model\] are the same section"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config([path])


def test_bench_runs_a_few_steps_without_eval_or_wandb():
    config = load_config([REPO / "configs" / "default.toml"], [("bench", "true"), ("wandb.project", "p")])
    assert (config.run.max_steps, config.eval.env, config.wandb) == (4, [], None)


def test_strictly_on_policy_turns_prefetching_off():
    config = load_config([], [("packer.max_off_policy_steps", "0")])
    assert (config.packer.prefetch_steps, config.packer.prefetch) == (1, 0)
    assert load_config([], []).packer.prefetch == 1


def test_sft_from_reference_answers_needs_no_teacher_and_one_sample_per_task():
    config = load_config([], [("env.0.id", "reasoning_gym"), ("env.0.mode", "sft"),
                              ("env.0.sft_source", "reference"), ("packer.batch_size", "8")])
    assert config.teacher is None and config.env[0].group_size == 1
    inherited = load_config([], [("training_mode", "sft"), ("env.0.id", "reasoning_gym"),
                                 ("env.0.sft_source", "reference")])
    assert (inherited.env[0].mode, inherited.env[0].group_size) == ("sft", 1)
    with pytest.raises(ConfigError, match="or sft_source = \"reference\""):
        load_config([], [("env.0.id", "echo_chars"), ("env.0.mode", "sft")])
    with pytest.raises(ConfigError, match="set its group_size = 1, not 4"):
        load_config([], [("env.0.id", "echo_chars"), ("env.0.mode", "sft"), ("env.0.sft_source", "reference"),
                         ("env.0.group_size", "4")])
