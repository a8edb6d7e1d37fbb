"""``model.path`` as transformers reads it: a local folder, or a Hugging Face hub id (``Qwen/Qwen3-0.6B``).

A hub id is fetched once into the hub cache before the workers start (they then read it from the cache, as
``from_pretrained`` does); offline, it must be cached already, and the error says so in one line.
"""

import os
import re
from pathlib import Path

from huggingface_hub import snapshot_download, try_to_load_from_cache

from bus.errors import ConfigError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""``org/name``, as the hub spells repository ids."""


def is_hub_id(path: str) -> bool:
    """True for ``org/name`` that is not a local path (a folder of that name wins, as in transformers)."""
    return not Path(path).exists() and HUB_ID.match(path) is not None and not path.startswith(".")


def hub_cached(repo_id: str) -> bool:
    """The model's ``config.json`` is in the local hub cache."""
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def fetch_hub_model(repo_id: str, what: str = "model.path", *, download: bool = True) -> None:
    """``repo_id`` in the hub cache (downloaded if it is not); a one-line ConfigError when it cannot be. With
    ``download=False`` (``--dry-run``) nothing is fetched: only a model neither cached nor fetchable (offline) fails."""
    if hub_cached(repo_id):
        return
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        raise ConfigError(f"{what}={repo_id!r} is a hub id not in the local cache and HF_HUB_OFFLINE is set; "
                          f"download it where the hub is reachable (`hf download {repo_id}`) or set {what} to a "
                          "local folder")
    if not download:
        return
    try:
        snapshot_download(repo_id, etag_timeout=10)
    except (OSError, ValueError) as e:  # the hub's errors are OSErrors
        reason = " ".join(str(e).split())[:100]
        raise ConfigError(f"{what}={repo_id!r} is a hub id not in the local cache and the hub cannot be reached "
                          f"(offline? {reason}); download it where the hub is reachable (`hf download {repo_id}`) "
                          f"or set {what} to a local folder") from e
