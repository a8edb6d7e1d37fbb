"""The config rlbus run hands its children: resolved, written as TOML, read back; thread shares."""

import pytest

from tests.paths import CONFIGS, REPO
from workers.config_loader import load_config
from workers.run.resolved import child_password, dump_toml, resolve, torch_threads


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_resolved_config_round_trips(path, tmp_path):
    config = load_config([path])
    data = resolve(config, redis_url="redis://127.0.0.1:1/0", base_urls=["http://127.0.0.1:9/v1"], threads=1)
    out = tmp_path / "resolved.toml"
    out.write_text(dump_toml(data))
    back = load_config([out])
    assert back.redis.url == "redis://127.0.0.1:1/0"
    assert back.inference.base_urls == ["http://127.0.0.1:9/v1"]
    assert back.trainer.num_threads == 1 and back.ckpt.resume_step == -1
    expected = config.model_dump(exclude={"redis", "inference", "trainer", "ckpt"})
    assert back.model_dump(exclude={"redis", "inference", "trainer", "ckpt"}) == expected


def test_torch_threads_share_the_cores():
    config = load_config([REPO / "configs" / "default.toml"])
    assert torch_threads(config, cores=2) == 1  # trainer + one inference server on 2 cores
    assert torch_threads(config, cores=16) == 8
    assert torch_threads(config, cores=1) == 1


def test_a_run_on_reference_answers_gives_the_policy_servers_core_to_the_trainer():
    sft = load_config([REPO / "configs" / "quickstart.toml"]).stage[0].config  # its servers answer eval alone
    assert torch_threads(sft, cores=2) == 2
    data = resolve(sft, redis_url="redis://127.0.0.1:1/0", base_urls=[], threads=torch_threads(sft, cores=2))
    assert data["trainer"]["num_threads"] == 2 and data["inference"]["num_threads"] == 1
    rl = load_config([REPO / "configs" / "quickstart.toml"]).stage[1].config
    assert torch_threads(rl, cores=2) == 1


def test_a_password_in_the_redis_url_reaches_children_through_the_environment_only():
    config = load_config([REPO / "configs" / "default.toml"])
    url = "redis://:hunter2@127.0.0.1:1/0"
    data = resolve(config, redis_url=url, base_urls=[], threads=1)
    text = dump_toml(data)
    assert "hunter2" not in text and 'url = "redis://127.0.0.1:1/0"' in text
    assert data["redis"]["password_var"] == "RLBUS_REDIS_PASSWORD"
    assert child_password(config, url) == {"RLBUS_REDIS_PASSWORD": "hunter2"}
    assert child_password(config, "redis://127.0.0.1:1/0") == {}


def test_the_private_redis_password_file_reaches_children_whose_config_has_no_redis_section(tmp_path):
    """`rlbus run` names its private Redis's password file on the parsed config; a config without a [redis] section
    (its section unset) must still hand it to the children. Before, only the OpenEnv e2e run caught it: every child
    failed AUTH."""
    source = tmp_path / "run.toml"
    source.write_text('[[env]]\nid = "echo_chars"\n')
    config = load_config([source])
    config.redis.password_file = str(tmp_path / "password")
    data = resolve(config, redis_url="redis://127.0.0.1:1/0", base_urls=[], threads=1)
    assert data["redis"]["password_file"] == str(tmp_path / "password")
    written = tmp_path / "config.resolved.toml"
    written.write_text(dump_toml(data))
    assert load_config([written]).redis.password_file == str(tmp_path / "password")
