"""``model.path`` as a hub id: told apart from local paths as transformers does; offline and not cached, the run
stops before it starts with one line saying so."""

import pytest

from bus.errors import ConfigError
from workers.config import RlbusConfig
from workers.run.checks import check_models, dry_run_problems
from workers.run.hub import is_hub_id


def test_a_hub_id_is_org_slash_name_that_is_not_a_local_folder(tmp_path, monkeypatch):
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT")
    for local in ("./models/tiny", "../tiny", "/abs/tiny", "outputs/models/tiny", "tiny"):
        assert not is_hub_id(local), local
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen" / "Qwen3-0.6B").mkdir(parents=True)
    assert not is_hub_id("Qwen/Qwen3-0.6B")  # a folder of that name wins


def test_an_uncached_hub_id_offline_stops_the_run_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    config = RlbusConfig.model_validate({"model": {"path": "rlbus-test/not-cached"}})
    with pytest.raises(ConfigError) as e:
        check_models(config)
    assert str(e.value) == ("model.path='rlbus-test/not-cached' is a hub id not in the local cache and "
                            "HF_HUB_OFFLINE is set; download it where the hub is reachable "
                            "(`hf download rlbus-test/not-cached`) or set model.path to a local folder")


def test_dry_run_fetches_no_model_and_stops_only_where_none_could_be_fetched(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("workers.run.hub.snapshot_download", lambda *a, **k: pytest.fail("dry-run downloaded"))
    config = RlbusConfig.model_validate({"model": {"path": "rlbus-test/not-cached"}, "env": [{"id": "echo_chars"}]})
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert dry_run_problems(config) == []  # `rlbus run` would fetch it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert dry_run_problems(config) == [
        "model.path='rlbus-test/not-cached' is a hub id not in the local cache and HF_HUB_OFFLINE is set; download "
        "it where the hub is reachable (`hf download rlbus-test/not-cached`) or set model.path to a local folder"]
