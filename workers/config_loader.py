"""Loading a run's config: ``@ a.toml @ b.toml --section.key value`` → :class:`RlbusConfig`.

- Files deep-merge in order (later files win; tables merge key by key, arrays are replaced).
- ``--section.key value`` overrides a key (a top-level key: ``--group-size 4``); the value is read as a TOML
  literal (``4``, ``true``,
  ``[0.9, 0.95]``, ``"text"``), else taken as a string; ``none``/``null`` unset a key. A flag
  without a value (``--log.json``) means ``true``. Arrays of tables are addressed by index:
  ``--env.0.group_size 4`` (index = current length appends a new table).
- Every problem raises ConfigError naming the dotted field and the fix.
"""

import difflib
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from bus.errors import ConfigError
from workers.config import RlbusConfig, StageConfig, deep_merge


def read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"config file {path} does not exist; check the path after '@'") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from e


def parse_value(text: str) -> Any:
    """A TOML literal (number, bool, array, inline table, quoted string), else the text itself."""
    if text.lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(data: dict, dotted: str, value: Any) -> None:
    """Set ``dotted`` (``section.key``, ``env.0.group_size``) in ``data`` in place."""
    parts = dotted.split(".")
    if any(p == "" for p in parts):
        raise ConfigError(f"--{dotted}: empty key segment; write --section.key VALUE")
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        where = ".".join(parts[:i]) or "the config"
        if isinstance(node, list):
            if not part.isdigit():
                raise ConfigError(f"--{dotted}: {where} is an array of tables; address it by index ({where}.0.…)")
            index = int(part)
            if index > len(node):
                raise ConfigError(
                    f"--{dotted}: {where} has {len(node)} entries; use an index up to {len(node)} "
                    f"({len(node)} appends a new one)"
                )
            if index == len(node):
                node.append({})
            if last:
                node[index] = value
            else:
                node = node[index]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"--{dotted}: {where} is a value ({node!r}), not a table; override {where} itself")
        if last:
            if value is None:
                node.pop(part, None)
            else:
                node[part] = value
        else:
            node = node.setdefault(part, [] if parts[i + 1].isdigit() else {})


def load_config(files: list[Path] = (), overrides: list[tuple[str, Any]] = ()) -> RlbusConfig:
    """Merge ``files`` in order, apply ``overrides`` ((dotted key, value) pairs), validate."""
    data: dict = {}
    for path in files:
        data = deep_merge(data, read_toml(Path(path)))
    for dotted, value in overrides:
        apply_override(data, dotted, parse_value(value) if isinstance(value, str) else value)
    try:
        return RlbusConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_errors(e)) from e


def format_errors(error: ValidationError) -> str:
    """One line per problem: the dotted field, what was wrong, and how to fix it."""
    lines = []
    for err in error.errors():
        _, loc = _walk([str(p) for p in err["loc"]])
        path = ".".join(loc)
        if err["type"] == "extra_forbidden":
            parent, _ = _walk([str(p) for p in err["loc"][:-1]])
            known = sorted({name for m in _models(parent) for name in m.model_fields})
            close = difflib.get_close_matches(loc[-1], known, n=1)
            hint = f"did you mean {'.'.join(loc[:-1] + close)}?" if close else f"known keys: {', '.join(known)}"
            lines.append(f"unknown key {path}; {hint}")
        elif not loc:
            lines.append(err["msg"].removeprefix("Value error, "))
        else:
            shown = repr(err.get("input"))[:80]
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{path}={shown}: {msg}; fix it in the TOML or with --{path} VALUE")
    head = "invalid config" if len(lines) == 1 else f"invalid config ({len(lines)} problems)"
    return head + ":\n  " + "\n  ".join(lines)


def _walk(loc: list[str]) -> tuple[Any, list[str]]:
    """Follow a pydantic error location from RlbusConfig: (annotation found, the user's dotted parts).

    Discriminated-union tags (``trainer.loss.cispo.eps_low``) are not part of the user's path.
    """
    node: Any = RlbusConfig
    shown: list[str] = []
    for part in loc:
        step, is_tag = _step(node, part)
        if not is_tag:
            shown.append(part)
        node = step
    return node, shown


def _step(node: Any, part: str) -> tuple[Any, bool]:
    for model in _models(node):
        if part in model.model_fields:
            return model.model_fields[part].annotation, model is StageConfig and part == "config"
    for model in _models(node):
        tag = model.model_fields.get("type")
        if tag is not None and part in typing.get_args(tag.annotation):
            return model, True
    for arg in [node, *typing.get_args(node)]:
        if part.isdigit() and typing.get_origin(arg) is list:
            return typing.get_args(arg)[0], False
    return None, False


def _models(node: Any) -> list[type[BaseModel]]:
    """The pydantic models inside an annotation (unwrapping Optional, unions and Annotated)."""
    if isinstance(node, type) and issubclass(node, BaseModel):
        return [node]
    origin = typing.get_origin(node)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return [m for a in typing.get_args(node) for m in _models(a)]
    return []


def split_argv(argv: list[str]) -> tuple[list[Path], list[tuple[str, str]], list[str], bool]:
    """Split a role's command line into (config files, dotted overrides, role options, dry_run).

    ``@ file`` or ``@file`` names a config file; ``--a.b value`` / ``--a.b=value`` is an override;
    ``--dry-run`` is the CLI's own; everything else (``--port 8000``) goes to the role untouched.
    """
    files: list[Path] = []
    overrides: list[tuple[str, str]] = []
    role_args: list[str] = []
    dry_run = False
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "@":
            if i + 1 >= len(argv):
                raise ConfigError("'@' must be followed by a TOML file: rlbus ROLE @ config.toml")
            files.append(Path(argv[i + 1]))
            i += 2
            continue
        if token.startswith("@"):
            files.append(Path(token[1:]))
        elif token == "--dry-run":
            dry_run = True
        elif token.startswith("--") and _is_config_key(token[2:].split("=", 1)[0]):
            key, eq, value = token[2:].partition("=")
            key = key if "." in key else key.replace("-", "_")
            if not eq:
                has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--") and argv[i + 1] != "@"
                value = argv[i + 1] if has_value else "true"
                i += has_value
            overrides.append((key, value))
        else:
            role_args.append(token)
        i += 1
    return files, overrides, role_args, dry_run


def _top_level_keys() -> set[str]:
    """The keys of RlbusConfig that are values, not sections (``group_size``, ``bench``…), with their aliases."""
    keys = set()
    for name, field in RlbusConfig.model_fields.items():
        if not _models(field.annotation):
            keys.add(name)
            keys.update(getattr(field.validation_alias, "choices", ()))
    return keys


def _is_config_key(flag: str) -> bool:
    return "." in flag or flag.replace("-", "_") in _top_level_keys()


def dump_json(config: RlbusConfig) -> str:
    """The resolved config as JSON (``--dry-run``)."""
    return json.dumps(config.model_dump(mode="json"), indent=2)
