"""Paths of the repository, for tests that run its files (configs, benchmarks, docker-compose.yml)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
"""The repository root."""

CONFIGS = sorted((REPO / "configs").glob("*.toml"))
"""Every shipped config."""
