"""Reading prime-rl files as one combined config: each file's role from its name or keys, split files under their
section, and a one-line error for anything that is not part of an rl run."""

from pathlib import Path

import pytest

from bus.errors import ConfigError
from workers.tools.prime_rl_layout import combine, read, role


@pytest.mark.parametrize(("path", "data", "expected"), [
    ("rl.toml", {"orchestrator": {}}, "rl"),
    ("configs/x/orch.toml", {"batch_size": 8}, "orchestrator"),
    ("configs/orchestrator/math/7b.toml", {"batch_size": 8}, "orchestrator"),
    ("configs/x/train.toml", {"optim": {}}, "trainer"),
    ("configs/inference/math/7b.toml", {"model": {}}, "inference"),
    ("configs/reverse_text/sft.toml", {"data": {}}, "sft"),
    ("mine.toml", {"environment": {"id": "x"}}, "orchestrator"),
    ("mine.toml", {"model": {"name": "x"}}, "unknown"),
])
def test_a_files_role_comes_from_its_name_then_its_keys(path, data, expected):
    assert role(Path(path), data) == expected


def test_split_files_combine_under_their_sections():
    combined = combine([(Path("orch.toml"), {"batch_size": 8}), (Path("train.toml"), {"optim": {"lr": 1e-6}}),
                        (Path("infer.toml"), {"parallel": {"tp": 2}})])
    assert combined == {"orchestrator": {"batch_size": 8}, "trainer": {"optim": {"lr": 1e-6}},
                        "inference": {"parallel": {"tp": 2}}}


def test_two_orchestrator_configs_or_an_sft_one_beside_them_are_refused():
    with pytest.raises(ConfigError, match="a.toml and orch.toml both hold an orchestrator config"):
        combine([(Path("a.toml"), {"orchestrator": {}}), (Path("orch.toml"), {})])
    with pytest.raises(ConfigError, match="sft.toml is a prime-rl sft config, not part of an rl run"):
        combine([(Path("rl.toml"), {"orchestrator": {}}), (Path("sft.toml"), {})])


def test_read_names_the_path_mistake(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("a = ")
    with pytest.raises(ConfigError, match="bad.toml is not valid TOML"):
        read(bad)
    with pytest.raises(ConfigError, match="is a folder"):
        read(tmp_path)
