"""A model with no hub: a byte-level tokenizer and a random-init Qwen3, saved as a Hugging Face folder.

``rlbus init-model --out DIR [--preset tiny|small] [--seed N]`` writes a folder that
``AutoTokenizer.from_pretrained(DIR)`` and ``AutoModelForCausalLM.from_pretrained(DIR)`` load offline.

The tokenizer maps every byte to one token (256 tokens, GPT-2's byte-to-unicode alphabet, no merges),
then the special tokens. Any UTF-8 text round-trips through encode/decode. The chat template is ChatML;
``<|im_end|>`` ends a turn (eos), ``<|endoftext|>`` pads.
"""

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from bus.errors import ConfigError
from workers.config import RlbusConfig

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Special tokens, ids 256, 257, 258 (after the 256 byte tokens)."""

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message; the generation prompt opens an assistant
turn."""

PRESETS: dict[str, dict[str, int]] = {
    # ~0.53M parameters: fast enough to sample and train on a shared CPU core.
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, intermediate_size=512),
    # ~25M parameters.
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=64, intermediate_size=1536),
}
"""Qwen3 shapes per preset (all with tied embeddings and 2048 positions)."""


def build_tokenizer():
    """The byte-level tokenizer with special tokens and the ChatML template (a transformers fast tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = _byte_alphabet()
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {char: byte for byte, char in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode map as a list: entry b is the printable character standing for byte b."""
    printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def build_model(out_dir: Path | str, preset: str = "tiny", seed: int = 0, replace: bool = True) -> Path:
    """Write tokenizer + random-init Qwen3 of ``preset`` to ``out_dir`` (atomically) and return the path.
    ``replace=False``: a model that appears at ``out_dir`` meanwhile (a concurrent builder) is kept, not replaced."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown model preset {preset!r}; use one of {sorted(PRESETS)}")
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    out = Path(out_dir)
    tokenizer = build_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **PRESETS[preset],
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if replace and out.exists():
            shutil.rmtree(out)
        try:
            os.replace(tmp, out)
        except OSError:
            if replace or not (out / "config.json").exists():
                raise
            shutil.rmtree(tmp)  # another process built it first: keep theirs
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(config: RlbusConfig | None, argv: list[str]) -> int:
    """``rlbus init-model``: build the tokenizer and random-init model folder."""
    parser = argparse.ArgumentParser(prog="rlbus init-model", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=config.model.path if config else None,
                        required=config is None, help="folder to write (default: model.path)")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        default=(config.model.init_preset if config else None) or "tiny")
    parser.add_argument("--seed", type=int, default=config.run.seed if config else 0)
    parser.add_argument("--if-missing", action="store_true",
                        help="keep a model already at --out; of concurrent callers one builds, the rest keep it "
                             "(a container's init step)")
    args = parser.parse_args(argv)
    if args.if_missing and (Path(args.out) / "config.json").exists():
        print(f"model_present path={args.out}")
        return 0
    if args.if_missing and config is not None and config.model.init_preset is None:
        raise ConfigError(f"model.path={args.out!r} holds no model (no config.json) and model.init_preset is unset, "
                          "so none is built; put the model there or set model.init_preset")
    out = build_model(args.out, preset=args.preset, seed=args.seed, replace=not args.if_missing)
    print(f"model_written path={out} preset={args.preset} seed={args.seed}")
    return 0
