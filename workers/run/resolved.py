"""The config ``rlbus run`` hands its children: the user's settings resolved (Redis URL, servers, threads,
resume step) and written as TOML that every child reads with ``@ config.resolved.toml``.
"""

import json
import os
from typing import Any

from bus.config import split_password
from workers.config import RlbusConfig

CHILD_PASSWORD_VAR = "RLBUS_REDIS_PASSWORD"
"""Where ``rlbus run`` hands its children a password that was in the Redis URL (never in a file)."""


def dump_toml(data: dict[str, Any]) -> str:
    """A nested dict (JSON-like values, None dropped) as TOML text."""
    lines: list[str] = []
    _dump_table(data, [], lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _key(name: str) -> str:
    return name if name and all(c.isalnum() or c in "-_" for c in name) else json.dumps(name)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _dump_table(table: dict[str, Any], path: list[str], lines: list[str]) -> None:
    for k, v in table.items():
        if v is not None and not (isinstance(v, dict) and v) and not _is_table_array(v):
            lines.append(f"{_key(k)} = {_value(v)}")
    for k, v in table.items():
        if isinstance(v, dict) and v:
            lines += ["", "[" + ".".join(map(_key, path + [k])) + "]"]
            _dump_table(v, path + [k], lines)
        elif _is_table_array(v):
            for item in v:
                lines += ["", "[[" + ".".join(map(_key, path + [k])) + "]]"]
                _dump_table(item, path + [k], lines)


def _set(data: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[last] = value


def needs_teacher_server(config: RlbusConfig) -> bool:
    """True when an env asks a teacher (opd, or sft from the teacher) and [teacher] names no servers: ``rlbus run``
    starts one."""
    asks = any(e.mode == "opd" or (e.mode == "sft" and e.sft_source == "teacher") for e in config.env)
    return config.teacher is not None and not config.teacher.base_urls and asks


def policy_samples_training(config: RlbusConfig) -> bool:
    """Whether the policy's inference servers sample the training rollouts (an rl or opd env). In a run that trains
    only on reference or teacher answers they answer eval alone, a burst every ``eval.interval`` steps."""
    return any(env.mode in ("rl", "opd") for env in config.env)


def torch_threads(config: RlbusConfig, cores: int | None = None) -> int:
    """Threads per torch-heavy process (trainer ranks, inference and teacher servers share the cores): max(1, C // N).
    Policy servers that answer eval alone are not counted: they run one thread (:func:`resolve`)."""
    cores = cores or len(os.sched_getaffinity(0))
    local_servers = 0 if config.inference.base_urls else config.inference.servers
    heavy = config.trainer.nproc + (local_servers if policy_samples_training(config) else 0)
    heavy += needs_teacher_server(config)
    return max(1, cores // max(1, heavy))


def child_password(config: RlbusConfig, redis_url: str) -> dict[str, str]:
    """The environment children need for a password that was in the Redis URL (nothing otherwise)."""
    _, password = split_password(redis_url)
    return {CHILD_PASSWORD_VAR: password} if password is not None and config.redis.password_var is None else {}


def resolve(config: RlbusConfig, *, redis_url: str, base_urls: list[str], threads: int,
            teacher_urls: list[str] = ()) -> dict[str, Any]:
    """The config children get: the user's settings plus the redis URL, servers, threads, resume step.

    ``ckpt.resume_step`` defaults to -1 (latest): a restarted trainer continues from its last
    checkpoint; a fresh run has none (its output_dir was cleared), so it starts from step 0. A password
    in the URL is not written: children read it from :data:`CHILD_PASSWORD_VAR` (see :func:`child_password`).
    """
    data = config.model_dump(mode="json", exclude_unset=True)
    url, password = split_password(redis_url)
    _set(data, "redis.url", url)
    if password is not None and config.redis.password_var is None:
        _set(data, "redis.password_var", CHILD_PASSWORD_VAR)
    if config.redis.password_file is not None:  # set by `rlbus run` for its private Redis: written even when the
        _set(data, "redis.password_file", config.redis.password_file)  # user's config has no [redis] section
    if base_urls:
        _set(data, "inference.base_urls", base_urls)
    if teacher_urls:
        _set(data, "teacher.base_urls", list(teacher_urls))
    if config.trainer.num_threads is None:
        _set(data, "trainer.num_threads", threads)
    if config.inference.num_threads is None:
        _set(data, "inference.num_threads", threads if policy_samples_training(config) else 1)
    if config.ckpt.resume_step is None:
        _set(data, "ckpt.resume_step", -1)
    RlbusConfig.model_validate(data)
    return data
