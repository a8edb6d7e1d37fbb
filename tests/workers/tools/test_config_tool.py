"""``rlbus config``: the generated reference page is complete and current; ``convert`` writes a prime-rl config
as rlbus's, says what it left, runs ``rlbus run``'s start-up checks, and turns path mistakes into one line."""

import os
import subprocess
import sys
import tomllib

import pytest

from tests.paths import REPO
from tests.workers.tools.test_prime_rl_convert import CORPUS, MANIFEST
from workers.config_loader import load_config
from workers.tools.config_docs import missing_docstrings, render_page
from workers.tools.config_tool import DOCS
from workers.tools.init_model import build_model
from workers.tools.migration_art import ART
from workers.tools.migration_prime_rl import ENV, ENV_ARRAYS, PRIME_RL
from workers.tools.prime_rl_convert import convert
from workers.tools.startup_check import startup_problems

PRIME_RL_CONFIG = '''
[orchestrator]
training_mode = "rl"
batch_size = 128
rollouts_per_example = 16
max_off_policy_steps = 4
seq_len = 4096
max_steps = 200
oversampling_factor = 2.0
output_dir = "outputs/reverse"
pool_size = 8

[orchestrator.optim]
lr = 3e-6

[orchestrator.model]
name = "PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT"

[orchestrator.model.client]
base_url = "http://localhost:8000/v1"

[orchestrator.tokenizer]
name = "Qwen/Qwen3-0.6B"

[orchestrator.train.sampling]
max_tokens = 128
temperature = 0.8

[[orchestrator.train.env]]
id = "reverse-text"
ratio = 1.0
timeout = { rollout = 120 }
sampling = { temperature = 0.6, extra_body = { top_k = 20 } }
args = { num_examples = 10, split = "train" }

[[orchestrator.train.env]]
id = "echo-chars"
ratio = 2.0
num_workers = 4

[orchestrator.eval]
interval = 50
num_examples = 32

[orchestrator.eval.sampling]
temperature = 0.0
reasoning_effort = "low"

[[orchestrator.eval.env]]
id = "reverse-text"
interval = 25

[[orchestrator.post_batch_filters]]
type = "zero_advantage"
enforce = false

[orchestrator.ckpt]
interval = 20
keep_last = 2
wait_for_weights_timeout = 600
skip_progress = true

[orchestrator.weight_broadcast]
type = "nccl"
port = 29600
inference_world_size = 2

[orchestrator.wandb]
project = "rl"
'''


def test_every_field_has_a_docstring_and_the_page_is_current():
    assert missing_docstrings() == []
    assert DOCS.read_text() == render_page(), "docs/configuration.md is out of date: run `rlbus config docs`"
    checked = subprocess.run([sys.executable, "-m", "workers.cli", "config", "docs", "--check"], cwd=REPO)
    assert checked.returncode == 0
    page = DOCS.read_text()
    own = [f for f in PRIME_RL if not f.startswith(tuple(f"{a}." for a in ENV_ARRAYS))]
    for field in [*own, *(f"[].{k}" for k in ENV), *ART]:  # the tables the converter uses are on the page
        assert f"| `{field}` |" in page, field


def rlbus_convert(*args, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workers.cli", "config", "convert", "--from", "prime-rl",
                           *map(str, args)], cwd=cwd, capture_output=True, text=True)


def test_a_combined_config_converts_and_convert_says_what_would_stop_the_run(tmp_path):
    data = convert(tomllib.loads(PRIME_RL_CONFIG)).data
    assert (data["group_size"], data["training_mode"]) == (16, "rl")
    assert data["model"] == {"path": "PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT"}
    assert data["trainer"] == {"lr": 3e-6, "weight_transport": "nccl", "nccl_port": 29600, "inference_world_size": 2}
    first, second = data["env"]
    assert first == {"id": "reverse-text", "ratio": 1.0, "rollout_timeout_s": 120,
                     "sampling": {"temperature": 0.6, "extra_body": {"top_k": 20}},
                     "args": {"num_examples": 10, "split": "train"}}  # tables of the user's own keys, whole
    assert second == {"id": "echo-chars", "ratio": 2.0}

    source, out = tmp_path / "rl.toml", tmp_path / "rlbus.toml"
    source.write_text(PRIME_RL_CONFIG)
    done = rlbus_convert(source, "--out", out)
    assert done.returncode == 2, done.stderr
    assert "    orchestrator.pool_size: no renderer pool" in done.stderr
    assert "  [[env]] 1 (echo-chars):\n    orchestrator.train.env[1].num_workers: rlbus runs one env server" \
        in done.stderr
    assert "would stop `rlbus run`: env.0 ('reverse-text'): unknown env id 'reverse-text'" in done.stderr
    assert "would stop `rlbus run`: eval.env.0 ('reverse-text'): unknown env id" in done.stderr
    config = load_config([out])  # written all the same, to edit
    assert config.env[0].group_size == 16 and config.env[0].sampling.temperature == 0.6
    assert config.env[1].sampling.temperature == 0.8 and config.eval.env[0].num_examples == 32


def test_a_converted_current_reverse_text_config_starts_with_only_its_env_edited(tmp_path, monkeypatch):
    entry = max((e for e in MANIFEST if e["source"] == "examples/basic/reverse-text/rl.toml"), key=lambda e: e["date"])
    out = tmp_path / "rlbus.toml"
    done = rlbus_convert(CORPUS / entry["file"], "--out", out, cwd=tmp_path)
    assert done.returncode == 2  # a verifiers env, not runnable here yet:
    assert "would stop `rlbus run`: env.0 (" in done.stderr and "taskset" in done.stderr
    data = tomllib.loads(out.read_text())
    build_model(tmp_path / data["model"]["path"], preset="tiny")  # the hub id's name, as a local folder
    data["env"] = [{"id": "reverse_text"}]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no netrc: no W&B login
    assert startup_problems(data) == [  # prime-rl logs to W&B online: a login is what remains
        'wandb.mode = "online" needs a W&B API key and none is configured; set WANDB_API_KEY, run `wandb login`, '
        'or set wandb.mode = "offline"']
    monkeypatch.setenv("WANDB_API_KEY", "a-key")
    assert startup_problems(data) == []


VERIFIERS_SOURCE = '''
[orchestrator]
batch_size = 8
rollouts_per_example = 4

[orchestrator.model]
name = "./policy"  # not there: rlbus run builds a random-init tiny one (a hub id would be fetched)

[[orchestrator.train.source]]
name = "echo"

[orchestrator.train.source.env.taskset]
id = "rlbus-test-echo"
num_tasks = 16

[orchestrator.train.source.env.agent]
max_turns = 1
'''


def test_a_converted_verifiers_env_block_passes_run_dry_run_when_its_taskset_is_installed(tmp_path, monkeypatch):
    pytest.importorskip("verifiers.v1", reason="needs the verifiers extra: pip install 'rlbus[verifiers]'")
    tasksets = REPO / "tests" / "workers" / "envs" / "vf_tasksets"  # as if pip-installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tasksets), str(REPO)]))
    source, out = tmp_path / "orch.toml", tmp_path / "rlbus.toml"
    source.write_text(VERIFIERS_SOURCE)
    done = rlbus_convert(source, "--out", out, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert tomllib.loads(out.read_text())["env"][0]["taskset"] == {"id": "rlbus-test-echo", "num_tasks": 16}
    dry_run = [sys.executable, "-m", "workers.cli", "run", "@", str(out), "--dry-run"]
    done = subprocess.run(dry_run, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out.write_text(out.read_text().replace("rlbus-test-echo", "rlbus-test-missing"))
    done = subprocess.run(dry_run, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("rlbus run: env.0 ('echo'): ") \
        and "taskset 'rlbus-test-missing' not found" in done.stderr, done.stderr


def test_a_file_that_is_not_an_orchestrator_config_says_so(tmp_path):
    trainer = tmp_path / "train.toml"
    trainer.write_text("[optim]\nlr = 1e-6\n")
    done = rlbus_convert(trainer)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"rlbus config: no orchestrator config among {trainer} (a trainer config): convert needs prime-rl's rl.toml "
        "(with [orchestrator]) or an orchestrator file (orch.toml), with its trainer and inference files"]


def test_path_mistakes_are_one_line_errors(tmp_path):
    source = tmp_path / "rl.toml"
    source.write_text(PRIME_RL_CONFIG)
    latin = tmp_path / "latin.toml"
    latin.write_bytes("# caf\xe9\n".encode("latin-1"))
    cases = [((tmp_path,), "is a folder; give the prime-rl config file(s) in it"),
             ((source, "--out", tmp_path / "missing" / "x.toml"), "does not exist; create it or write elsewhere"),
             ((source, "--out", tmp_path), "is a folder; give a file path"),
             ((latin,), "is not UTF-8 text (byte 5)"),
             ((tmp_path / "nope.toml",), "does not exist; check the path")]
    for args, message in cases:
        done = rlbus_convert(*args)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, (args, done.stderr)
        assert message in done.stderr, done.stderr
