"""``reverse_text``: reverse a short string character by character (prime-rl's debug environment).

Reward ``lcs_ratio`` = difflib's SequenceMatcher ratio between the model's answer (stripped) and the
reversed text: 1.0 for an exact reversal, partial credit for near misses. The dataset is generated
from a fixed word list with a seeded RNG: no downloads, the same examples on every machine.
"""

import random
from difflib import SequenceMatcher

from workers.envs.base import Environment, Example, Message, RewardFunc, Rubric, State, last_reply

SYSTEM_PROMPT = "Reverse the text character by character. Reply with the reversed text only."

WORDS = (
    "apple river stone cloud green tiger piano seven light ocean bread chair dream eagle flame grape "
    "house juice kite lemon mouse night olive pearl queen robot sugar train umbra vivid whale yacht zebra "
    "amber bison cedar delta ember frost globe honey ivory jelly koala lunar maple noble orbit prism quilt "
    "raven sheep tulip unity valve wheat xenon yodel zesty"
).split()


def lcs_ratio(example: Example, messages: list[Message], state: State) -> float:
    """Similarity of the answer to the reversed text (1.0 = exact)."""
    return SequenceMatcher(None, last_reply(messages).strip(), example["answer"]).ratio()


def make_dataset(num_examples: int, min_words: int, max_words: int, seed: int) -> list[Example]:
    rng = random.Random(seed)
    examples = []
    for i in range(num_examples):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
        examples.append({"id": i, "text": text, "answer": text[::-1]})
    return examples


def load_environment(
    num_examples: int = 2000, min_words: int = 1, max_words: int = 2, seed: int = 0
) -> Environment:
    """Reverse 1–2 random words (``num_examples`` examples, seeded)."""
    if not 1 <= min_words <= max_words:
        raise ValueError(f"need 1 <= min_words <= max_words, got min_words={min_words} max_words={max_words}")

    def prompt(example: Example) -> list[Message]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": example["text"]}]

    return Environment(
        "reverse_text",
        make_dataset(num_examples, min_words, max_words, seed),
        prompt,
        Rubric([RewardFunc(lcs_ratio)]),
    )
