"""``rlbus config``: the generated reference page is complete and current; a prime-rl config converts."""

import subprocess
import sys
import tomllib

from tests.paths import REPO
from workers.config_loader import load_config
from workers.tools.config_docs import missing_docstrings, render_page
from workers.tools.config_tool import DOCS, convert_prime_rl
from workers.tools.migration import ART, PRIME_RL

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
    for field in [*PRIME_RL, *ART]:  # both mapping tables are on the page
        assert f"| `{field}` |" in page, field


def test_a_prime_rl_orchestrator_config_converts_and_says_what_it_left(tmp_path):
    data, left = convert_prime_rl(tomllib.loads(PRIME_RL_CONFIG))
    assert (data["group_size"], data["training_mode"]) == (16, "rl")
    assert data["model"] == {"path": "PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT"}
    assert data["feeder"] == {"oversampling_factor": 2.0} and data["wandb"] == {"project": "rl"}
    assert data["packer"] == {"batch_size": 128, "max_off_policy_steps": 4, "seq_len": 4096,
                              "post_batch_filters": [{"type": "zero_advantage", "enforce": False}]}
    assert data["run"] == {"max_steps": 200, "output_dir": "outputs/reverse"}
    assert data["trainer"] == {"lr": 3e-6, "weight_transport": "nccl", "nccl_port": 29600,
                               "inference_world_size": 2}
    assert data["inference"] == {"base_urls": ["http://localhost:8000/v1"]}
    assert data["sampling"] == {"max_completion_tokens": 128, "temperature": 0.8}
    first, second = data["env"]
    assert first == {"id": "reverse-text", "ratio": 1.0, "rollout_timeout_s": 120,
                     "sampling": {"temperature": 0.6, "extra_body": {"top_k": 20}},
                     "args": {"num_examples": 10, "split": "train"}}  # tables of the user's own keys, whole
    assert second == {"id": "echo-chars", "ratio": 2.0}
    assert data["eval"]["env"] == [{"id": "reverse-text", "interval": 25}]
    assert data["eval"]["sampling"] == {"temperature": 0.0, "reasoning_effort": "low"}
    assert data["ckpt"] == {"interval": 20, "keep_last": 2, "wait_for_weights_timeout": 600, "skip_progress": True}
    reasons = dict(left)
    assert set(reasons) == {"pool_size", "tokenizer.name", "train.env[1].num_workers"}
    assert "rollout.workers" in reasons["train.env[1].num_workers"] and "model.path" in reasons["tokenizer.name"]

    source = tmp_path / "rl.toml"
    source.write_text(PRIME_RL_CONFIG)
    out = tmp_path / "rlbus.toml"
    done = subprocess.run([sys.executable, "-m", "workers.cli", "config", "convert", "--from", "prime-rl",
                           str(source), "--out", str(out)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "not carried over: pool_size: no renderer pool" in done.stderr
    config = load_config([out])
    assert config.env[0].group_size == 16 and config.env[0].sampling.temperature == 0.6
    assert config.env[1].sampling.temperature == 0.8 and config.eval.env[0].num_examples == 32
