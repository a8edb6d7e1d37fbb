"""``echo_chars``: answer with the characters of the prompt — a task a tiny random-init model learns on CPU.

The prompt is a short run of one or two printable ASCII characters (``"kkk"``, ``"#q#qq"``); the
answer should consist of those characters. Only the first ``answer_len`` characters of the answer
count (missing characters score 0), so keep ``max_completion_tokens`` at or above it (4–8).

Reward ``closeness``: the mean, over those characters, of a credit that depends on the prompt. The
94 printable characters ``!``..``~`` form a ring (``~`` is next to ``!``); a character at ring
distance ``d`` from the nearest prompt character gets ``max(0, 1 - d / width)``: 1.0 for a prompt
character, less for its neighbours, 0 beyond ``width`` and for anything that is not printable
ASCII (spaces, control bytes, other bytes). Why this shape:

- A random-init byte-level model samples roughly uniformly over ~260 tokens, so exact-match
  rewards start near 0 and GRPO gets no signal. With ``width = 12`` about 19 % of random
  characters near a prompt character earn some credit: a uniform sampler scores ≈ 0.065, and most
  groups of 8 completions differ in reward from the start.
- The credit is centred on the prompt's characters, and they are spread over the whole ring, so a
  constant answer cannot win: the best constant character scores ≈ 0.2 on average, while echoing
  the prompt scores 1.0. Rising past 0.2 means the model reads its prompt.

Metric ``exact`` (weight 0) is the fraction of the counted characters that occur in the prompt:
the sharp version of the same skill.
"""

import random

from workers.envs.base import Environment, Example, Message, RewardFunc, Rubric, State, last_reply

FIRST, LAST = 33, 126  # '!' .. '~'
RING = LAST - FIRST + 1


def char_credit(char: str, targets: str, width: float) -> float:
    """Credit of one answer character: 1 - (ring distance to the nearest target) / width, floored at 0."""
    code = ord(char)
    if not FIRST <= code <= LAST:
        return 0.0
    best = 0.0
    for target in targets:
        d = abs(code - ord(target))
        d = min(d, RING - d)
        best = max(best, 1.0 - d / width)
    return best


def make_dataset(num_examples: int, min_len: int, max_len: int, seed: int) -> list[Example]:
    rng = random.Random(seed)
    alphabet = [chr(c) for c in range(FIRST, LAST + 1)]
    examples = []
    for i in range(num_examples):
        chars = rng.sample(alphabet, rng.choice((1, 2)))
        length = rng.randint(max(min_len, len(chars)), max_len)
        run = chars + [rng.choice(chars) for _ in range(length - len(chars))]
        rng.shuffle(run)
        examples.append({"id": i, "text": "".join(run), "chars": "".join(sorted(chars))})
    return examples


def load_environment(
    num_examples: int = 4096,
    min_len: int = 3,
    max_len: int = 6,
    answer_len: int = 4,
    width: float = 12.0,
    seed: int = 0,
) -> Environment:
    """Echo runs of 1–2 characters; ``answer_len`` answer characters count; credit reaches ``width`` ring steps."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len} max_len={max_len}")
    if answer_len < 1 or not 1 <= width <= RING // 2:
        raise ValueError(f"need answer_len >= 1 and 1 <= width <= {RING // 2}, got {answer_len=} {width=}")

    def counted(messages: list[Message]) -> str:
        return last_reply(messages)[:answer_len]

    def closeness(example: Example, messages: list[Message], state: State) -> float:
        return sum(char_credit(c, example["chars"], width) for c in counted(messages)) / answer_len

    def exact(example: Example, messages: list[Message], state: State) -> float:
        return sum(c in example["chars"] for c in counted(messages)) / answer_len

    def prompt(example: Example) -> list[Message]:
        return [{"role": "user", "content": example["text"]}]

    return Environment(
        "echo_chars",
        make_dataset(num_examples, min_len, max_len, seed),
        prompt,
        Rubric([RewardFunc(closeness), RewardFunc(exact, weight=0.0)]),
    )
