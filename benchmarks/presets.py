"""Random-init Qwen3 shapes for the trainer and weights benchmarks (no tokenizer, no hub)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def use_repo_imports() -> None:
    """Make ``import trainer`` find the package, not ``benchmarks/trainer.py`` (the script's own dir)."""
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [str(ROOT)] + [p for p in sys.path if p not in ("", here, str(ROOT))] + [here]


PRESETS = {
    # CPU default: checkable on a shared 2-core box in well under a minute.
    "tiny": dict(vocab_size=8192, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "small": dict(vocab_size=32768, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    # Qwen3-0.6B's shape.
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0),
}


def build(preset: str, device, dtype, seed: int = 0):
    """A random-init Qwen3ForCausalLM of ``preset`` on ``device`` in ``dtype`` (SDPA, tied embeddings, no cache)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**PRESETS[preset], tie_word_embeddings=True, max_position_embeddings=40960, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    return model.to(dtype).train()
