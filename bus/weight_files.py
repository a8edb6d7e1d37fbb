"""Checking a safetensors weights event before loading it: where its directory is, and what its files hold.

An inference server loads only directories under its weights root (``output_dir/weights``) whose every
shard has the size and sha256 the event names, so a stray or forged event cannot point a server at
arbitrary files, and a shard modified or half-written after the event was published is never served.
"""

import hashlib
from pathlib import Path

from bus.messages import WeightFile, WeightUpdate


def weights_root(output_dir: Path | str) -> Path:
    """``output_dir/weights``: where a run's trainer writes its weight directories (``step_{s}``)."""
    return Path(output_dir) / "weights"


def sha256_of(path: Path | str) -> str:
    """Hex sha256 of a file."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify_weights(dir: Path | str, files: list[WeightFile]) -> None:
    """Raise ValueError when a shard's size or sha256 differs from the weights event."""
    for f in files:
        path = Path(dir) / f.name
        if path.stat().st_size != f.bytes or sha256_of(path) != f.sha256:
            raise ValueError(f"weights file {path} does not match its event (size or sha256); "
                             "it was modified or partly written")


def check_update(event: WeightUpdate, root: Path | str) -> None:
    """Raise ValueError unless a safetensors event's directory lies under ``root`` and its files match the event."""
    if event.dir is None or not event.files:
        raise ValueError(f"weights event of step {event.step} names no directory or no files")
    dir, root = Path(event.dir).resolve(), Path(root).resolve()
    if not dir.is_relative_to(root):
        raise ValueError(f"weights directory {dir} of step {event.step} is not under the weights root {root}; "
                         "an inference server loads only what its own run's trainer wrote")
    verify_weights(dir, event.files)
