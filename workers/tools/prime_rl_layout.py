"""Reading prime-rl config files as one combined ``rl.toml``: files → ``{top level, orchestrator, trainer,
inference}``.

prime-rl has had two layouts: one ``rl.toml`` with ``[orchestrator]``, ``[trainer]`` and ``[inference]`` beside
the shared top level, and split files (``orch.toml``, ``train.toml``, ``infer.toml``, or ``configs/orchestrator/…``
beside ``configs/trainer/…``) given to its launcher together. Each file's role comes from its name (the file, then
its folders, nearest first), else from its keys; a split file is read under its section, so one mapping table
(:mod:`workers.tools.migration_prime_rl`) serves both.
"""

import tomllib
from pathlib import Path

from bus.errors import ConfigError
from workers.config import deep_merge

ROLE_WORDS = {"orch": "orchestrator", "orchestrator": "orchestrator", "train": "trainer", "trainer": "trainer",
              "infer": "inference", "inference": "inference", "sft": "sft", "eval": "eval", "evals": "eval"}
"""A file or folder name → the role of the prime-rl config in it."""

ORCHESTRATOR_KEYS = {"environment", "env", "rollouts_per_example", "rollouts_per_prompt", "group_size", "train",
                     "async_level", "max_async_level", "mask_truncated_completions", "sampling", "max_off_policy_steps"}
"""Top-level keys only an orchestrator config has."""

SECTIONS = ("orchestrator", "trainer", "inference")
"""The roles a split file can play in a combined config."""


def read(path: Path) -> dict:
    """A TOML file's tables; every path mistake is a one-line ConfigError."""
    if path.is_dir():
        raise ConfigError(f"{path} is a folder; give the prime-rl config file(s) in it (rl.toml, or orch.toml "
                          "with train.toml and infer.toml)")
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError as e:
        raise ConfigError(f"{path} does not exist; check the path") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}); a prime-rl config is a TOML file") from e
    except OSError as e:
        raise ConfigError(f"{path} cannot be read: {e.strerror}") from e
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from e


def role(path: Path, data: dict) -> str:
    """``rl`` (a combined config), ``orchestrator``, ``trainer``, ``inference``, ``sft``, ``eval`` or ``unknown``."""
    if "orchestrator" in data:
        return "rl"
    for name in (path.stem, *reversed(path.parent.parts)):
        if name.lower() in ROLE_WORDS:
            return ROLE_WORDS[name.lower()]
    if ORCHESTRATOR_KEYS & set(data):
        return "orchestrator"
    return "unknown"


def combine(files: list[tuple[Path, dict]], roles_given: dict[Path, str] | None = None) -> dict:
    """One combined config from the files a user gives; a ConfigError unless exactly one of them holds an
    orchestrator config and the others are its trainer and inference parts (``roles_given`` overrides
    :func:`role` for the files it names)."""
    roles = [(path, (roles_given or {}).get(path) or role(path, data), data) for path, data in files]
    bearing = [path for path, kind, _ in roles if kind in ("rl", "orchestrator")]
    if not bearing:
        described = ", ".join(f"{path} ({_described(kind)})" for path, kind, _ in roles)
        raise ConfigError(f"no orchestrator config among {described}: convert needs prime-rl's rl.toml (with "
                          "[orchestrator]) or an orchestrator file (orch.toml), with its trainer and inference files")
    if len(bearing) > 1:
        raise ConfigError(f"{' and '.join(map(str, bearing))} both hold an orchestrator config; give one (with its "
                          "trainer and inference files)")
    out: dict = {}
    for path, kind, data in roles:
        if kind not in ("rl", *SECTIONS):
            raise ConfigError(f"{path} is {_described(kind)}, not part of an rl run; give the orchestrator file "
                              "with its trainer and inference files only")
        out = deep_merge(out, data if kind == "rl" else {kind: data})
    return out


def _described(kind: str) -> str:
    return {"sft": "a prime-rl sft config", "eval": "a prime-rl eval config", "trainer": "a trainer config",
            "inference": "an inference config"}.get(kind, "not a prime-rl orchestrator config")
