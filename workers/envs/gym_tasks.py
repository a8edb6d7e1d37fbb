"""``reasoning_gym``: a task suite nobody here wrote — reasoning-gym's procedural generators, scored by their own
scorers (no network: examples are generated from a seed).

    [[env]]
    id = "reasoning_gym"
    args = { dataset = "spell_backward", size = 2000, seed = 1 }

Any other key in ``args`` goes to the generator's config (``min_word_len = 3`` …). Each example's answer is its
reference, so ``mode = "sft"`` with ``sft_source = "reference"`` can train on it first. Needs
``pip install 'rlbus[reasoning-gym]'``.
"""

from typing import Any

from workers.envs.base import Environment, Example, Message, RewardFunc, Rubric, State, last_reply


def load_environment(dataset: str, size: int = 1000, seed: int = 0, system_prompt: str | None = None,
                     **config: Any) -> Environment:
    """reasoning-gym's ``dataset`` generator with ``size`` examples from ``seed``."""
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

    def prompt(example: Example) -> list[Message]:
        head = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return head + [{"role": "user", "content": example["question"]}]

    def score(example: Example, messages: list[Message], state: State) -> float:
        return float(generated.score_answer(last_reply(messages).strip(), example))

    return Environment(f"reasoning_gym/{dataset}", entries, prompt, Rubric([RewardFunc(score, name="score")]),
                       reference=lambda example: str(example["answer"]))
