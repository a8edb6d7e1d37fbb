"""Config loading: files merge in order, overrides win, unknown keys and bad values name the field and the fix."""

import json
from pathlib import Path

import pytest

from bus.errors import ConfigError
from tests.paths import CONFIGS, REPO
from workers import cli
from workers.config import RlbusConfig
from workers.config_loader import apply_override, load_config, parse_value, split_argv
from workers.envs.registry import load_env


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads(path):
    config = load_config([path])
    assert isinstance(config, RlbusConfig)
    assert config.run.name
    for env in [*config.env, *config.eval.env]:  # the env args fit the env factories
        assert len(load_env(env.id, env.args)) > 0


def test_default_config_exists():
    assert (REPO / "configs" / "default.toml") in CONFIGS


def test_files_merge_in_order_and_overrides_win(tmp_path):
    base = write(
        tmp_path / "base.toml",
        """
        [run]
        name = "base"
        seed = 1
        [trainer]
        lr = 1e-3
        warmup_steps = 5
        [[env]]
        id = "reverse_text"
        group_size = 4
        """,
    )
    top = write(
        tmp_path / "top.toml",
        """
        [run]
        name = "top"
        [trainer]
        lr = 2e-4
        [[env]]
        id = "guess_number"
        """,
    )
    config = load_config([base, top], [("trainer.lr", "3e-4"), ("env.0.group_size", "2")])
    assert config.run.name == "top" and config.run.seed == 1  # tables merge key by key
    assert config.trainer.lr == 3e-4 and config.trainer.warmup_steps == 5
    assert [e.id for e in config.env] == ["guess_number"]  # arrays are replaced
    assert config.env[0].group_size == 2


def test_unknown_key_in_a_file_is_named_with_a_hint(tmp_path):
    path = write(tmp_path / "c.toml", '[[env]]\nid = "reverse_text"\ngroup_sise = 4\n')
    with pytest.raises(ConfigError, match=r"unknown key env\.0\.group_sise; did you mean env\.0\.group_size\?"):
        load_config([path])


def test_unknown_override_and_section():
    with pytest.raises(ConfigError, match=r"unknown key trainer\.lrr; did you mean trainer\.lr\?"):
        load_config([], [("trainer.lrr", "1")])
    with pytest.raises(ConfigError, match=r"unknown key trainner; did you mean trainer\?"):
        load_config([], [("trainner.lr", "1")])
    with pytest.raises(ConfigError, match=r"unknown key trainer\.loss\.eps_lo; did you mean trainer\.loss\.eps_low\?"):
        load_config([], [("trainer.loss.type", "cispo"), ("trainer.loss.eps_lo", "0.1")])


def test_bad_values_name_the_field_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"redis\.maxlen=0: .*greater than or equal to 1.*--redis\.maxlen VALUE"):
        load_config([], [("redis.maxlen", "0")])
    with pytest.raises(ConfigError, match="not divisible by group_size=3"):
        load_config([], [("env.0.id", "reverse_text"), ("env.0.group_size", "3"), ("packer.batch_size", "8")])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config([tmp_path / "missing.toml"])
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config([write(tmp_path / "bad.toml", "[run\n")])


@pytest.mark.parametrize(
    "text, value",
    [("4", 4), ("1e-4", 1e-4), ("true", True), ("[0.9, 0.95]", [0.9, 0.95]), ('"4"', "4"), ("abc", "abc"),
     ("redis://h:1/0", "redis://h:1/0"), ("none", None), ("{a = 1}", {"a": 1})],
)
def test_override_values_are_toml_literals_else_strings(text, value):
    assert parse_value(text) == value


def test_array_of_tables_by_index():
    data = {"env": [{"id": "a"}]}
    apply_override(data, "env.0.group_size", 4)
    apply_override(data, "env.1.id", "b")
    assert data == {"env": [{"id": "a", "group_size": 4}, {"id": "b"}]}
    with pytest.raises(ConfigError, match="has 2 entries"):
        apply_override(data, "env.5.id", "c")
    with pytest.raises(ConfigError, match="address it by index"):
        apply_override(data, "env.id", "c")
    apply_override(data, "run.max_steps", None)
    assert data["run"] == {}


def test_split_argv():
    files, overrides, role_args, dry_run = split_argv(
        ["@", "a.toml", "@b.toml", "--env.0.group_size", "4", "--log.json", "--port", "8000", "--x.y=3",
         "--trainer.lr", "-1", "--dry-run"]
    )
    assert files == [Path("a.toml"), Path("b.toml")]
    assert overrides == [("env.0.group_size", "4"), ("log.json", "true"), ("x.y", "3"), ("trainer.lr", "-1")]
    assert role_args == ["--port", "8000"] and dry_run


def test_dry_run_prints_the_resolved_config(tmp_path, capsys):
    path = write(tmp_path / "c.toml", '[run]\nname = "demo"\n[[env]]\nid = "reverse_text"\n')
    assert cli.main(["trainer", "@", str(path), "--trainer.lr", "5e-5", "--log.json", "--dry-run"]) == 0
    resolved = json.loads(capsys.readouterr().out)
    assert resolved["run"]["name"] == "demo" and resolved["trainer"]["lr"] == 5e-5
    assert resolved["env"][0]["group_size"] == 8 and resolved["log"]["json_lines"] is True
    assert load_config([], []).model_validate(resolved) is not None  # the JSON loads back


def test_cli_reports_config_errors(capsys):
    assert cli.main(["packer", "--packer.seq_len", "2", "--dry-run"]) == 2
    assert "packer.seq_len=2" in capsys.readouterr().err


def test_passwords_are_redacted_in_dry_run_output(tmp_path):
    from workers.config_loader import dump_json

    config = load_config([], [("redis.url", "redis://u:hunter2@h:1/0")])
    shown = dump_json(config)
    assert "hunter2" not in shown and "redis://u:***@h:1/0" in shown


def test_lora_is_one_override_and_refuses_what_it_cannot_do(tmp_path):
    config = load_config([], [("model.lora.rank", "4")])
    assert config.model.lora.rank == 4 and config.model.lora.resolved_name == "r4-a16"
    with pytest.raises(ConfigError, match=r"model\.lora\.rank=0"):
        load_config([], [("model.lora.rank", "0")])
    with pytest.raises(ConfigError, match='weight_transport = "safetensors"'):
        load_config([], [("model.lora.rank", "4"), ("trainer.weight_transport", "nccl")])
    staged = write(tmp_path / "staged.toml", '[[stage]]\nname = "a"\n[stage.model.lora]\nrank = 4\n'
                                            '[[stage]]\nname = "b"\n')
    with pytest.raises(ConfigError, match="rlbus export"):
        load_config([staged])
