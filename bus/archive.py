"""An on-disk archive of trained steps: ``output_dir/batches/step_{s}.msgpack`` holds the entries of ``batches:{s}``.

Each file is one msgpack list of the entries' field maps, exactly as they were in Redis (header fields and
``data``), written to a temp file and renamed, so ``rlbus replay --from-archive`` can put a run's steps back
into streams after Redis deleted them (the trainer deletes ``batches:{s}`` once a checkpoint covers step s).
"""

import os
from pathlib import Path

import msgpack

from bus.errors import DecodeError


def archive_dir(output_dir: Path | str) -> Path:
    """``output_dir/batches``."""
    return Path(output_dir) / "batches"


def archive_path(output_dir: Path | str, step: int) -> Path:
    """``output_dir/batches/step_{step}.msgpack``."""
    return archive_dir(output_dir) / f"step_{step}.msgpack"


def write_step(output_dir: Path | str, step: int, entries: list[dict[str, bytes | str]]) -> Path:
    """Write the field maps of step ``step``'s entries atomically; returns the file."""
    path = archive_path(output_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_bytes(msgpack.packb(entries, use_bin_type=True))
    os.replace(tmp, path)
    return path


def read_step(path: Path | str) -> list[dict[bytes, bytes]]:
    """The field maps of one archived step, as Redis returns them (bytes keys and values)."""
    try:
        entries = msgpack.unpackb(Path(path).read_bytes(), raw=True)
    except Exception as e:
        raise DecodeError(f"{path} is not a batches archive: {type(e).__name__}: {e}") from e
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise DecodeError(f"{path} is not a batches archive (expected a list of field maps)")
    return entries


def archived_steps(dir: Path | str) -> list[tuple[int, Path]]:
    """Every ``step_{s}.msgpack`` under ``dir``, by step."""
    found = []
    for path in Path(dir).glob("step_*.msgpack"):
        step = path.stem.removeprefix("step_")
        if step.isdigit():
            found.append((int(step), path))
    return sorted(found)
