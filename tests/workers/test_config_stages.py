"""``[[stage]]``: each stage is the top level with its tables merged over it, in its own folder and run name."""

from pathlib import Path

import pytest

from bus.errors import ConfigError
from workers.config_loader import load_config

CHAIN = """
[run]
name = "chain"
output_dir = "out/chain"
[trainer]
lr = 1e-3
[[env]]
id = "reverse_text"

[[stage]]
name = "sft"
[stage.run]
max_steps = 5
[[stage.env]]
id = "reverse_text"
mode = "sft"
sft_source = "reference"

[[stage]]
name = "rl"
[stage.run]
max_steps = 7
[stage.trainer]
lr = 5e-5
"""


def chain(tmp_path: Path, text: str = CHAIN, overrides=()):
    path = tmp_path / "chain.toml"
    path.write_text(text)
    return load_config([path], list(overrides))


def test_each_stage_is_the_top_level_with_its_tables_merged_over_it(tmp_path):
    config = chain(tmp_path)
    sft, rl = config.stage
    assert (sft.name, sft.config.run.name, sft.config.run.output_dir) == ("sft", "chain-sft", Path("out/chain/sft"))
    assert (rl.config.run.name, rl.config.run.output_dir) == ("chain-rl", Path("out/chain/rl"))
    assert (sft.config.run.max_steps, rl.config.run.max_steps) == (5, 7)
    assert (sft.config.trainer.lr, rl.config.trainer.lr) == (1e-3, 5e-5)  # inherited, then overridden
    assert sft.config.env[0].mode == "sft" and sft.config.env[0].group_size == 1  # its [[stage.env]] replaced [[env]]
    assert rl.config.env[0].mode == "rl" and rl.config.env[0].group_size == 8
    assert (sft.from_previous, rl.from_previous) == (False, True)
    assert not sft.config.stage and not rl.config.stage


def test_a_stage_that_names_its_model_starts_from_it(tmp_path):
    config = chain(tmp_path, CHAIN + '[stage.model]\npath = "elsewhere"\n')
    assert not config.stage[1].from_previous and config.stage[1].config.model.path == "elsewhere"


def test_one_stage_is_overridden_by_its_index(tmp_path):
    config = chain(tmp_path, overrides=[("stage.1.run.max_steps", "50"), ("stage.0.run.output_dir", "x")])
    assert config.stage[1].config.run.max_steps == 50
    assert config.stage[0].config.run.output_dir == Path("x")


def test_a_bad_value_in_a_stage_names_the_stage_key_and_its_override(tmp_path):
    with pytest.raises(ConfigError) as e:
        chain(tmp_path, overrides=[("stage.1.trainer.lr", "fast")])
    assert "stage.1.trainer.lr='fast'" in str(e.value) and "--stage.1.trainer.lr VALUE" in str(e.value)


def test_an_unknown_key_in_a_stage_is_named_with_a_suggestion(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key stage\.1\.trainer\.lrr; did you mean stage\.1\.trainer\.lr"):
        chain(tmp_path, overrides=[("stage.1.trainer.lrr", "1")])


def test_stage_names_differ_and_the_first_has_no_previous(tmp_path):
    with pytest.raises(ConfigError, match="names must differ"):
        chain(tmp_path, overrides=[("stage.1.name", "sft")])
    with pytest.raises(ConfigError, match="has no previous stage"):
        chain(tmp_path, overrides=[("stage.0.from_previous", "true")])


def test_a_stage_cannot_start_from_weights_its_previous_stage_never_writes(tmp_path):
    with pytest.raises(ConfigError, match="writes no weights folder"):
        chain(tmp_path, overrides=[("stage.0.trainer.weight_transport", "nccl")])
