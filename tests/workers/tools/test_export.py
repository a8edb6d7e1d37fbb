"""``rlbus export``: a LoRA step (weights folder or checkpoint) becomes a merged Hugging Face folder that plain
transformers loads and that computes what base + adapter computes."""

import subprocess
import sys

import torch

from tests.paths import REPO
from trainer.checkpoint import Checkpointer
from trainer.config import CkptConfig
from trainer.dist import DistContext
from trainer.logprobs import PolicyModel
from trainer.lora import adapter_tensors, inject, peft_config, save_adapter
from trainer.model import load_model

IDS = torch.tensor([[257, 72, 101, 108, 108, 111, 10, 258]])


def lora_model(model_dir):
    """The tiny model with a rank-4 adapter whose B is random (so it changes the outputs)."""
    torch.manual_seed(0)
    lm = load_model(model_dir, torch.device("cpu"), torch.float32).eval()
    inject(lm, peft_config(4, 8, 0.0, ["q_proj", "v_proj", "down_proj"], str(model_dir)))
    with torch.no_grad():
        for name, param in lm.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.5)
    return lm


def rlbus_export(config, *args):
    return subprocess.run([sys.executable, "-m", "workers.cli", "export", "@", str(config), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=180)


def test_export_merges_a_lora_step_from_weights_and_from_a_checkpoint(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    config = tmp_path / "cfg.toml"
    config.write_text(f'[run]\noutput_dir = "{out}"\n[model]\npath = "{tiny_model_dir}"\n'
                      '[model.lora]\nrank = 4\nalpha = 8\ntarget_modules = ["q_proj", "v_proj", "down_proj"]\n')
    lm = lora_model(tiny_model_dir)
    with torch.no_grad():
        expected = lm(IDS).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)(IDS).logits
    assert not torch.allclose(expected, base, atol=1e-3)  # the adapter matters
    lora = peft_config(4, 8, 0.0, ["q_proj", "v_proj", "down_proj"], str(tiny_model_dir))
    save_adapter(adapter_tensors(lm.state_dict()), out / "weights" / "step_3", lora)
    policy = PolicyModel(lm)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad])
    Checkpointer(out, CkptConfig(interval=1), DistContext(), trainable_only=True).save(
        5, policy, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))

    for step, origin in (("3", "weights (LoRA adapter merged)"), ("5", "checkpoint (LoRA adapter merged)")):
        done = rlbus_export(config, "--step", step, "--out", str(tmp_path / f"merged-{step}"))
        assert done.returncode == 0, done.stderr
        assert f"from={origin}" in done.stdout
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / f"merged-{step}")
        assert not any("lora" in name for name in merged.state_dict())  # a plain model
        with torch.no_grad():
            torch.testing.assert_close(merged(IDS).logits, expected, atol=1e-4, rtol=1e-4)
        assert (tmp_path / f"merged-{step}" / "tokenizer_config.json").exists()

    newest = rlbus_export(config, "--out", str(tmp_path / "newest"))
    assert newest.returncode == 0 and "step=5" in newest.stdout
    missing = rlbus_export(config, "--step", "4", "--out", str(tmp_path / "x"))
    assert missing.returncode == 2 and "steps there: [3, 5]" in missing.stderr
    taken = rlbus_export(config, "--step", "3", "--out", str(tmp_path / "merged-3"))
    assert taken.returncode == 2 and "not empty" in taken.stderr
