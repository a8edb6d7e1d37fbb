"""The no-hub model: byte-level tokenizer + random-init Qwen3 that reload offline."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.tools.init_model import build_model, main

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("m") / "tiny", preset="tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_reloads_offline_with_expected_shape(model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    params = sum(p.numel() for p in model.parameters())
    assert 0.4e6 < params < 0.7e6
    assert model.config.vocab_size == len(tokenizer) == 259
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tokenizer.eos_token_id == 258


def test_chat_template_opens_an_assistant_turn(tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids[:1] == [257] and ids.count(258) == 2


@settings(max_examples=50, deadline=None)
@given(st.text())
def test_any_utf8_text_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_byte_tokens_are_byte_values(tokenizer):
    assert tokenizer.encode("A\x00é", add_special_tokens=False) == [65, 0, 0xC3, 0xA9]


def test_same_seed_same_weights(tmp_path, model_dir):
    again = build_model(tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()


def test_cli_entry_without_config(tmp_path, capsys):
    assert main(None, ["--out", str(tmp_path / "m"), "--preset", "tiny", "--seed", "3"]) == 0
    assert (tmp_path / "m" / "tokenizer.json").exists()
    assert "model_written" in capsys.readouterr().out


def test_if_missing_keeps_a_model_and_concurrent_builders_agree(tmp_path):
    import subprocess
    import sys

    from tests.paths import REPO

    out = tmp_path / "tiny"
    argv = [sys.executable, "-m", "workers.cli", "init-model", "--out", str(out), "--if-missing"]
    builders = [subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    for builder in builders:  # pods' init containers, all at once
        builder.communicate(timeout=120)
    assert [b.returncode for b in builders] == [0, 0, 0]
    assert (out / "config.json").exists() and not list(tmp_path.glob(".tiny.*"))  # one model, no leftovers
    stamp = (out / "config.json").stat().st_mtime_ns
    again = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "model_present" in again.stdout
    assert (out / "config.json").stat().st_mtime_ns == stamp  # kept, not rebuilt
