"""``reasoning_gym``: a task suite nobody here wrote — reasoning-gym's procedural generators, scored by their own
scorers (no network: examples are generated from a seed).

    [[env]]
    id = "reasoning_gym"
    args = { dataset = "spell_backward", size = 2000, seed = 1 }

Any other key in ``args`` goes to the generator's config (``min_word_len = 3`` …). ``holdout = 0.1`` sets aside
the examples whose answer falls in a fixed 10% of answers (by a hash of the answer text): ``split = "train"`` keeps
the rest, ``split = "held_out"`` only those, so a held-out eval never shares an answer with training, whatever the
seeds. Each example's answer is its reference, so ``mode = "sft"`` with ``sft_source = "reference"`` can train on it
first. Needs ``pip install 'rlbus[reasoning-gym]'``.
"""

import zlib
from typing import Any, Literal

from workers.envs.base import Environment, Example, Message, RewardFunc, Rubric, State, last_reply


def load_environment(dataset: str, size: int = 1000, seed: int = 0, system_prompt: str | None = None,
                     holdout: float = 0.0, split: Literal["train", "held_out"] = "train", **config: Any) -> Environment:
    """reasoning-gym's ``dataset`` generator with ``size`` examples from ``seed`` (those of ``split`` when
    ``holdout`` > 0)."""
    if split == "held_out" and not holdout:
        raise ValueError("split='held_out' needs holdout > 0 (the fraction of answers set aside), or it is the "
                         "whole dataset, training's too")
    if not 0.0 <= holdout < 1.0 or split not in ("train", "held_out"):
        raise ValueError(f"need 0 <= holdout < 1 and split 'train' or 'held_out', got holdout={holdout} "
                         f"split={split!r}")
    try:
        import reasoning_gym
    except ImportError as e:
        raise ValueError("the reasoning_gym env needs reasoning-gym: pip install 'rlbus[reasoning-gym]'") from e
    try:
        generated = reasoning_gym.create_dataset(dataset, size=size, seed=seed, **config)
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"reasoning-gym cannot build {dataset!r} with {config}: {e}") from e
    entries = [dict(entry) for entry in generated]
    if any(entry.get("answer") is None for entry in entries):
        raise ValueError(f"reasoning-gym's {dataset!r} gives examples without an answer; it cannot be a reference")
    if holdout:
        entries = [e for e in entries if held_out(str(e["answer"]), holdout) == (split == "held_out")]
        if not entries:
            raise ValueError(f"no {split} examples among {size} with holdout={holdout}; raise size")

    def prompt(example: Example) -> list[Message]:
        head = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return head + [{"role": "user", "content": example["question"]}]

    def score(example: Example, messages: list[Message], state: State) -> float:
        return float(generated.score_answer(last_reply(messages).strip(), example))

    return Environment(f"reasoning_gym/{dataset}", entries, prompt, Rubric([RewardFunc(score, name="score")]),
                       reference=lambda example: str(example["answer"]))


def held_out(answer: str, fraction: float) -> bool:
    """Whether examples with this answer belong to the held-out ``fraction`` (the same answer always does)."""
    return zlib.crc32(answer.encode()) % 10_000 < fraction * 10_000
