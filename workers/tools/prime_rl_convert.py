"""A combined prime-rl config (:mod:`workers.tools.prime_rl_layout`) → an rlbus config, and the account of it.

Every leaf of the source is either carried (written to its rlbus key with the user's value, or meaning what rlbus
does by default) or left behind with the reason; nothing is dropped silently. Defaults that differ between the two
(:data:`~workers.tools.migration_prime_rl.DEFAULTS`) are written explicitly, each with a comment.
"""

from dataclasses import dataclass, field
from typing import Any

from workers.tools.migration import Lost, Target, dotted, flatten, get, indexed, lookup, parents, stops
from workers.tools.migration_prime_rl import DEFAULTS, ENV_ARRAYS, FALLBACK, PRIME_RL, PRIME_RL_VERIFIERS

PARENTS = {id(PRIME_RL): parents(PRIME_RL), id(PRIME_RL_VERIFIERS): parents(PRIME_RL_VERIFIERS)}
"""Each table's paths that have rows below them."""


@dataclass
class Carried:
    """One source field that carried over."""

    source: str
    """Its path in the source (``orchestrator.train.source[0].name``)."""
    key: str | None
    """The rlbus key written (``env[0].name``); None: rlbus does the same by default, nothing written."""
    value: Any = None
    """The value written (the user's, in rlbus's terms)."""


@dataclass
class Conversion:
    data: dict = field(default_factory=dict)
    """The rlbus config."""
    carried: list[Carried] = field(default_factory=list)
    """Source fields carried over."""
    left: list[tuple[str, str]] = field(default_factory=list)
    """(source field, reason) of every field left behind."""
    defaults: dict[str, str] = field(default_factory=dict)
    """rlbus key → why it was written though the source does not set it (prime-rl's default differs)."""

    @property
    def faithful(self) -> bool:
        """Nothing left behind."""
        return not self.left


def verifiers_items(source: dict) -> set[tuple[str, int]]:
    """(array path, index) of every env block in the verifiers form (``taskset``, ``agent``, ``harness`` or a
    source's ``env`` table) rather than named by ``id``."""
    out = set()
    for array in ENV_ARRAYS:
        items = source
        for part in array.removesuffix("[]").split("."):
            items = items.get(part, {}) if isinstance(items, dict) else {}
        for i, item in enumerate(items if isinstance(items, list) else []):
            if isinstance(item, dict) and {"taskset", "agent", "harness", "env"} & set(item):
                out.add((array, i))
    return out


def seat(source: dict, path: str, indices: list[int], rows: dict[str, Target]) -> Target | None:
    """A table beside a verifiers ``taskset`` under a name no row knows (``player = {…}``) is one of that env's
    agent seats: carried whole to the same name in its ``[[env]]`` (verifiers checks the name when the run starts)."""
    parent, _, name = path.rpartition(".")
    taskset = rows.get(f"{parent}.taskset")
    beside_taskset = isinstance(_get(source, indexed(f"{parent}.taskset", indices)), dict)
    if taskset is None or taskset.key is None or not beside_taskset:
        return None
    if not isinstance(_get(source, indexed(path, indices)), dict):
        return None
    return Target(taskset.key.removesuffix(".taskset") + f".{name}", "a verifiers agent seat: 1:1", whole=True)


def convert(source: dict) -> Conversion:
    """The rlbus config of a combined prime-rl config, with what carried and what did not."""
    verifiers = verifiers_items(source)

    def table(path: str, indices: list[int]) -> dict[str, Target]:
        in_verifiers = any(path.startswith(array + ".") and indices[:1] == [i] for array, i in verifiers)
        return PRIME_RL_VERIFIERS if in_verifiers else PRIME_RL

    out = Conversion()
    def stop(path: str, indices: list[int]) -> bool:
        rows = table(path, indices)
        return stops(rows.get(path) or seat(source, path, indices, rows), path in PARENTS[id(rows)])

    for path, indices, value in flatten(source, stop):
        rows = table(path, indices)
        _carry(out, path, indices, value, lookup(path, rows) or seat(source, path, indices, rows))
    _final_checkpoint(out)
    _defaults(out, source)
    return out


def _final_checkpoint(out: Conversion) -> None:
    """An empty ``[ckpt]`` (a checkpoint at the end) as ``ckpt.interval = max_steps``; left behind without
    ``max_steps``, or beside an interval of the user's own."""
    empty = [c for c in out.carried if c.key is None and c.source.rpartition(".")[2] == "ckpt" and c.value == {}]
    steps, interval = _get(out.data, "run.max_steps"), _get(out.data, "ckpt.interval")
    for carried in empty:
        out.carried.remove(carried)
        if interval is None and steps is not None:
            out.data.setdefault("ckpt", {})["interval"] = steps
            out.carried.append(Carried(carried.source, "ckpt.interval", steps))
        else:
            out.left.append((carried.source, "its checkpoint at the end: rlbus checkpoints every ckpt.interval steps "
                             "only" + ("" if steps is not None else ", and the run has no max_steps to set it to")))


def _carry(out: Conversion, path: str, indices: list[int], value: Any, target: Target | None) -> None:
    shown = indexed(path, indices)
    if target is None:
        out.left.append((shown, next(r for prefix, r in FALLBACK.items() if path.startswith(prefix))))
    elif target.each and isinstance(value, list):
        for j, item in enumerate(value):
            _put(out, f"{shown}[{j}]", indexed(target.each, [j]), item)
    elif target.key is None and target.value is None:
        if target.same:
            out.carried.append(Carried(shown, None, value))
        else:
            out.left.append((shown, target.note or f"{path} is a list in prime-rl's 2025 eval layout"))
    elif target.spread:
        for name, item in value.items():
            _put(out, f"{shown}.{name}", f"{indexed(target.key, indices)}.{name}", item)
    else:
        try:
            written = target.value(value) if target.value else value
        except Lost as e:
            out.left.append((shown, str(e)))
            return
        if written is None or target.key is None:
            out.carried.append(Carried(shown, None, value))
        elif target.append:
            key = indexed(target.key, indices)
            _put(out, shown, key, (_get(out.data, key) or []) + written, carried=written)
        else:
            _put(out, shown, indexed(target.key, indices), written)


def _get(data: dict, key: str) -> Any:
    try:
        return get(data, key)
    except (KeyError, IndexError, TypeError):
        return None


def _put(out: Conversion, shown: str, key: str, value: Any, carried: Any = None) -> None:
    """Write ``value`` at ``key`` (``carried``: the part of it this field brings, for an appended list); a second,
    different value for a key already written is left behind."""
    before = _get(out.data, key)
    if before is not None and before != value and carried is None:
        first = next(c.source for c in out.carried if c.key == key)
        out.left.append((shown, f"{key} is already {before!r} from {first}"))
        return
    node: Any = out.data
    parts = dotted(key).split(".")
    for part, after in zip(parts, parts[1:], strict=False):
        if isinstance(node, list):
            while len(node) <= int(part):
                node.append({})
            node = node[int(part)]
        else:
            node = node.setdefault(part, [] if after.isdigit() else {})
    if isinstance(node, list):
        while len(node) <= int(parts[-1]):
            node.append({})
        node[int(parts[-1])] = value
    else:
        node[parts[-1]] = value
    out.carried.append(Carried(shown, key, value if carried is None else carried))


def _defaults(out: Conversion, source: dict) -> None:
    """prime-rl's default, written where the source leaves a field unset and rlbus's default differs."""
    sources = source.get("orchestrator", {}).get("train", {}).get("source", [])
    for _, key, value, why in DEFAULTS:
        if key.startswith("wandb.") and "wandb" not in out.data:
            continue
        if key == "sampling.max_completion_tokens":
            value = out.data.get("packer", {}).get("seq_len", 2048)
        for i in range(len(sources)) if "[]" in key else [None]:
            one = key if i is None else indexed(key, [i])
            if not _written(out, one):
                _set_default(out, one, value, why)


def _written(out: Conversion, key: str) -> bool:
    return _get(out.data, key) is not None


def _set_default(out: Conversion, key: str, value: Any, why: str) -> None:
    node = out.data
    *parents, last = dotted(key).split(".")
    for part, after in zip(parents, [*parents, last][1:], strict=True):
        if isinstance(node, list):
            node += [{} for _ in range(int(part) + 1 - len(node))]
            node = node[int(part)]
        else:
            node = node.setdefault(part, [] if after.isdigit() else {})
    node[last] = value
    out.defaults[key] = why
