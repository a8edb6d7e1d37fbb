"""``dataset``: examples from a local JSONL, JSON, Parquet or CSV file (Hugging Face ``datasets``, offline).

    [[env]]
    id = "dataset"
    args = { path = "data/train.jsonl", prompt_field = "question", answer_field = "answer", reward = "exact" }

Each row gives the prompt (a text field, or a chat ``messages_field`` of ``{role, content}`` dicts) and the
answer. Rewards: ``exact`` (1.0 when the reply equals the answer after normalising case and whitespace),
``lcs`` (difflib's similarity ratio) or ``math`` (``math-verify``: the reply's final expression is
mathematically equal to the answer). The answer is also the example's reference, so ``mode = "sft"`` with
``sft_source = "reference"`` trains on the file directly. A field the file does not have is an error that
lists its columns. Needs ``pip install 'rlbus[data]'``.
"""

import csv
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any

from workers.envs.base import Environment, Example, Message, RewardFunc, Rubric, State, last_reply

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""File suffix → the ``datasets`` builder that reads it."""


def normalise(text: str) -> str:
    return " ".join(str(text).strip().lower().split())


def exact(example: Example, messages: list[Message], state: State) -> float:
    """1.0 when the reply equals the answer (case and whitespace normalised)."""
    return float(normalise(last_reply(messages)) == normalise(example["answer"]))


def lcs(example: Example, messages: list[Message], state: State) -> float:
    """Similarity ratio of the reply to the answer (1.0 = equal; no junk heuristic, so long answers score fairly)."""
    return SequenceMatcher(None, last_reply(messages).strip(), str(example["answer"]).strip(), autojunk=False).ratio()


def math_equal(example: Example, messages: list[Message], state: State) -> float:
    """1.0 when math-verify finds the reply's answer equal to the reference answer."""
    from math_verify import parse, verify

    gold, reply = parse(str(example["answer"])), parse(last_reply(messages))
    return float(bool(gold) and bool(reply) and verify(gold, reply))


REWARDS = {"exact": exact, "lcs": lcs, "math": math_equal}


def read_rows(path: str, fmt: str | None = None) -> list[dict[str, Any]]:
    """Every row of the file, as dicts."""
    try:
        import datasets
    except ImportError as e:
        raise ValueError("the dataset env needs Hugging Face datasets: pip install 'rlbus[data]'") from e
    file = Path(path)
    if not file.exists():
        raise ValueError(f"path={path!r} does not exist")
    builder = fmt or FORMATS.get(file.suffix.lower())
    if builder is None:
        raise ValueError(f"path={path!r}: cannot tell its format from {file.suffix!r}; pass format = one of "
                         f"{sorted(set(FORMATS.values()))}")
    datasets.disable_progress_bars()
    options = {}
    if builder == "csv":  # every column as text, as written ("007" stays "007", an empty cell stays empty)
        with open(file, newline="") as f:
            header = next(csv.reader(f), [])
        options = {"features": datasets.Features({name: datasets.Value("string") for name in header}),
                   "keep_default_na": False}
    return list(datasets.load_dataset(builder, data_files=str(file), split="train", **options))


def load_environment(path: str, prompt_field: str = "prompt", answer_field: str = "answer",
                     messages_field: str | None = None, reward: str = "exact", system_prompt: str | None = None,
                     format: str | None = None, num_examples: int | None = None) -> Environment:
    """The file at ``path`` as an env (``num_examples``: only the first that many rows)."""
    if reward not in REWARDS:
        raise ValueError(f"reward={reward!r}; use one of {sorted(REWARDS)}")
    if reward == "math":
        try:
            import math_verify  # noqa: F401
        except ImportError as e:
            raise ValueError("reward = 'math' needs math-verify: pip install 'rlbus[data]'") from e
    rows = read_rows(path, format)[:num_examples]
    if not rows:
        raise ValueError(f"path={path!r} has no rows")
    source = messages_field or prompt_field
    missing = [f for f in (source, answer_field) if f not in rows[0]]
    if missing:
        raise ValueError(f"{path} has no field {missing[0]!r}; its columns are {sorted(rows[0])}")
    empty = [i for i, row in enumerate(rows)
             if row[answer_field] in (None, "") or row[answer_field] != row[answer_field]]  # x != x: NaN
    if empty:
        raise ValueError(f"{path}: rows {empty[:5]} have no {answer_field!r} (empty or NaN); fill or drop them")
    data = [{"id": i, "prompt": row[source], "answer": row[answer_field]} for i, row in enumerate(rows)]

    def prompt(example: Example) -> list[Message]:
        if messages_field is not None:
            messages = [{"role": m["role"], "content": m["content"]} for m in example["prompt"]]
        else:
            messages = [{"role": "user", "content": str(example["prompt"])}]
        return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + messages

    return Environment(Path(path).stem, data, prompt, Rubric([RewardFunc(REWARDS[reward], name=reward)]),
                       reference=lambda example: str(example["answer"]))
