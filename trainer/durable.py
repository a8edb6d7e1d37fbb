"""Publishing a directory so that a crash, or a power cut, never leaves a half-written one under its final name.

A checkpoint or weights folder is written into a temp directory next to its final name; :func:`publish_dir`
fsyncs every file in it and the directory itself, renames it into place, and fsyncs the parent, so the rename
(what readers see) reaches the disk only after the contents did. Without the fsyncs a rename can be persisted
before the data: after a power cut the folder is there, under its final name, with empty or torn files.
"""

import os
import shutil
from pathlib import Path


def fsync_path(path: Path | str) -> None:
    """fsync one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_dir(tmp: Path, final: Path) -> None:
    """fsync ``tmp``'s files and ``tmp``, replace ``final`` by it (one rename), fsync the parent."""
    for path in tmp.iterdir():
        if path.is_file():
            fsync_path(path)
    fsync_path(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(final.parent)
