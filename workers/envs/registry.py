"""Resolve an env id to an :class:`~workers.envs.base.Environment`: a built-in name or ``package.module:factory``."""

import importlib
import inspect
from typing import Any

from bus.errors import ConfigError
from workers.envs.base import Environment

BUILTIN = {
    "reverse_text": "workers.envs.reverse_text:load_environment",
    "echo_chars": "workers.envs.echo_chars:load_environment",
    "guess_number": "workers.envs.guess_number:load_environment",
    "dataset": "workers.envs.dataset:load_environment",
    "reasoning_gym": "workers.envs.gym_tasks:load_environment",
}
"""Built-in env ids and the factories they stand for."""


def load_env(env_id: str, args: dict[str, Any] | None = None) -> Environment:
    """Build the env ``env_id`` (built-in name or ``package.module:factory``) with keyword arguments ``args``."""
    path = BUILTIN.get(env_id, env_id)
    if ":" not in path:
        raise ConfigError(
            f"unknown env id {env_id!r}; use a built-in ({', '.join(BUILTIN)}) "
            "or an import path 'package.module:factory'"
        )
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"env id {env_id!r}: cannot import {module_name!r} ({e}); is the package installed?") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"env id {env_id!r}: module {module_name!r} has no callable {attr!r}")
    args = dict(args or {})
    try:
        inspect.signature(factory).bind(**args)
    except TypeError as e:
        raise ConfigError(
            f"env id {env_id!r}: args {sorted(args)} do not fit {attr}{inspect.signature(factory)}: {e}") from e
    try:
        env = factory(**args)
    except ValueError as e:
        raise ConfigError(f"env id {env_id!r} rejected args {args}: {e}") from e
    if not isinstance(env, Environment):
        raise ConfigError(f"env id {env_id!r}: {attr}() returned {type(env).__name__}, not an Environment")
    return env
