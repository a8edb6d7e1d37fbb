"""Fixtures of the stage tests."""

import json
from pathlib import Path

import pytest


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A model folder with just the config.json the filters read (vocab_size)."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    return tmp_path
