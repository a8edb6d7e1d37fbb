"""The shape of a migration table: another tool's field → where it lives in rlbus, or why it does not.

A table maps a field's path (``orchestrator.train.env[].sampling.temperature``; ``[]`` marks an array of tables)
to a :class:`Target`. The prime-rl table is :mod:`workers.tools.migration_prime_rl`, ART's
:mod:`workers.tools.migration_art`; ``rlbus config convert`` applies the first and ``docs/configuration.md``
prints both, so the converter and the page never disagree.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class Lost(Exception):
    """Raised by a :attr:`Target.value` for a value rlbus has no equivalent of; the message is the reason."""


@dataclass(frozen=True)
class Target:
    """The rlbus side of one field."""

    key: str | None
    """rlbus's dotted key (``[]`` where the field's array index goes); None: nothing is written (see ``same``)."""
    note: str = ""
    """How it differs (units, defaults); with no key, why there is no rlbus field."""
    value: Callable[[Any], Any] | None = None
    """Turns the value into rlbus's (None: the same value); returning None writes nothing (rlbus's default means
    the same)."""
    whole: bool = False
    """The value (a table or array of tables) carries over as it is, its own keys being rlbus's too."""
    spread: bool = False
    """The value is a table whose keys carry over one level up, into ``key`` (a prime-rl source's ``env`` table
    becomes the ``[[env]]`` itself)."""
    each: str | None = None
    """The key item ``i`` of a list value goes to (``[]`` filled by ``i``): prime-rl's 2025 eval layout gives
    per-env settings as lists in env order."""
    append: bool = False
    """The value (a list) is appended to the list at ``key`` (vLLM flags, several fields into one list)."""
    same: bool = False
    """With no key: rlbus does the same without a setting (the field is carried, not lost)."""

    @property
    def lost(self) -> bool:
        return self.key is None and not self.same


def lost(reason: str) -> Target:
    """A field rlbus has no equivalent for, with the reason."""
    return Target(None, reason)


def same(note: str) -> Target:
    """A field whose effect rlbus has without a setting."""
    return Target(None, note, same=True)


Stop = Callable[[str, list[int]], bool]
"""Whether the descent of :func:`flatten` stops at a path (with the array indices on the way)."""


def stops(target: Target | None, has_rows_below: bool) -> bool:
    """A table, or array of tables, carried whole, spread or left behind with everything under it is one leaf; a
    table left behind whose fields have rows of their own (``trainer.optim`` and ``trainer.optim.lr``), and one
    rlbus needs no setting for, is one only when empty: what is in it is looked up field by field."""
    if target is None:
        return False
    return target.whole or target.spread or (target.lost and not has_rows_below)


def parents(table: dict[str, Target]) -> set[str]:
    """Every path that has a row below it."""
    return {path.rsplit(".", i)[0] for path in table for i in range(1, path.count(".") + 1)}


def flatten(data: dict, stop: Stop, prefix: str = "", indices: tuple = ()) -> list[tuple[str, list[int], Any]]:
    """(path with ``[]`` for array items, the array indices on the way, value) of every leaf of ``data`` (an empty
    table is a leaf; ``stop`` says where else the descent ends)."""
    out = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if stop(path, list(indices)):
            out.append((path, list(indices), value))
        elif isinstance(value, dict) and value:
            out += flatten(value, stop, path + ".", indices)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, item in enumerate(value):
                out += flatten(item, stop, path + "[].", (*indices, i))
        else:
            out.append((path, list(indices), value))
    return out


def lookup(path: str, table: dict[str, Target]) -> Target | None:
    """The target of ``path``; else that of its nearest ancestor that is left behind with everything under it
    (``orchestrator.renderer``'s reason covers ``orchestrator.renderer.name``); else None."""
    if path in table:
        return table[path]
    while "." in path:
        path = path.rpartition(".")[0]
        if path in table and table[path].lost:
            return table[path]
    return None


def indexed(path: str, indices: list[int]) -> str:
    """``path`` with its ``[]`` filled by ``indices`` in order (``env[].id``, [1] → ``env[1].id``)."""
    for i in indices:
        path = path.replace("[]", f"[{i}]", 1)
    return path


def dotted(key: str) -> str:
    """An indexed key as the config loader's override path (``env[1].id`` → ``env.1.id``)."""
    return key.replace("[", ".").replace("]", "")


def get(data: Any, key: str) -> Any:
    """The value at an indexed key (``env[1].sampling.temperature``) of a nested dict; KeyError if absent."""
    node = data
    for part in dotted(key).split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node
