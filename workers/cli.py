"""``rlbus ROLE @ a.toml [@ b.toml] [--section.key value ...] [--role-option value] [--dry-run]``.

Dotted flags override the config; undotted flags go to the role's own argparse. Roles are
imported lazily, so ``--help`` and ``--dry-run`` never import torch; ``rlbus run --dry-run`` also runs the
start-up checks ``rlbus run`` makes (envs load, models are there, W&B can log in). A role's entry point is
``main(config: RlbusConfig | None, argv: list[str]) -> int``.
"""

import gc
import importlib
import sys
from typing import NoReturn

from bus.errors import CONFIG_EXIT_CODE, ConfigError, RedisNotInstalledError
from bus.log import configure_logging
from workers.config_loader import dump_json, load_config, split_argv

ROLES: dict[str, tuple[str, str]] = {
    "env": ("workers.envs.server:main", "serve one environment over ZeroMQ"),
    "inference": ("workers.inference.server:main", "OpenAI-compatible inference server that follows `weights`"),
    "feeder": ("workers.stages.feeder:main", "turn datasets into tasks, honouring ratios and max in-flight rollouts"),
    "rollout": ("workers.stages.rollout:main", "roll out tasks: sample groups, run episodes, score, publish"),
    "filter": ("workers.stages.filter:main", "compute advantages and apply the pre-batch filters"),
    "packer": ("workers.stages.packer:main", "pack filtered groups into the micro-batches of each step"),
    "trainer": ("trainer.worker:main", "train on each step's micro-batches, publish weights and versions"),
    "run": ("workers.run.chain:main", "start a whole run (or its [[stage]]s in turn) on this machine"),
    "exporter": ("workers.tools.exporter:main",
                 "serve a run's figures (streams, lag, versions, latency) to Prometheus"),
    "slurm": ("workers.tools.slurm:main", "submit a run (or more rollout workers) to a Slurm cluster"),
    "inspect": ("workers.tools.inspect_run:main",
                "show a run's streams, groups, lag and pending entries; decode entries"),
    "replay": ("workers.tools.replay:main", "copy recorded rollouts or batches of one run into another run"),
    "health": ("workers.tools.health:main", "liveness probe: is a ROLE worker on this host heartbeating?"),
    "redis": ("workers.tools.redis_server:main", "run a private redis-server in the foreground and print its URL"),
    "export": ("workers.tools.export:main", "write a trained step as a Hugging Face folder (a LoRA adapter merged)"),
    "init-model": ("workers.tools.init_model:main", "build a random-init tiny/small Qwen3 with a byte-level tokenizer"),
    "config": ("workers.tools.config_tool:main", "write the config reference, or convert a prime-rl config"),
}
"""Role name → ("module:function", one-line description)."""

NO_CONFIG_ROLES = {"inspect", "redis", "init-model", "replay", "config"}
"""Roles that get ``config=None`` when no @file or override was given."""


STAGED_ROLES = {"run", "config"}
"""Roles that take a config with ``[[stage]]``s (the others run one stage's config)."""

OWN_DRY_RUN_ROLES = {"slurm"}
"""Roles whose ``--dry-run`` is their own (it goes to the role's options instead of printing the config)."""


def usage() -> str:
    width = max(map(len, ROLES))
    lines = [
        "usage: rlbus ROLE [@ config.toml ...] [--section.key VALUE ...] [--role-option VALUE ...] [--dry-run]",
        "",
        "roles:",
        *(f"  {name:<{width}}  {desc}" for name, (_, desc) in ROLES.items()),
        "",
        "`rlbus ROLE --help` shows a role's own options; `--dry-run` prints the resolved config as JSON (`run`'s also "
        "runs the start-up checks).",
    ]
    return "\n".join(lines)


def load_role(role: str):
    """The entry function of ``role`` (imported now)."""
    target, _ = ROLES[role]
    module_name, func_name = target.split(":")
    return getattr(importlib.import_module(module_name), func_name)


def dry_run_checks(role: str, config) -> int:
    """``rlbus run --dry-run``: what would stop the run at start, one line each on stderr (exit 2), loading no
    model and fetching none; the other roles' ``--dry-run`` checks nothing beyond the config."""
    if role != "run":
        return 0
    from workers.run.checks import dry_run_problems

    problems = dry_run_problems(config)
    for problem in problems:
        print(f"rlbus run: {problem}", file=sys.stderr)
    return CONFIG_EXIT_CODE if problems else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    role, rest = argv[0], argv[1:]
    if role not in ROLES:
        print(f"rlbus: unknown role {role!r}; roles are {', '.join(ROLES)}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        files, overrides, role_args, dry_run = split_argv(rest)
        if dry_run and role in OWN_DRY_RUN_ROLES:
            role_args, dry_run = [*role_args, "--dry-run"], False
        config = None
        if files or overrides or dry_run or role not in NO_CONFIG_ROLES:
            config = load_config(files, overrides)
    except ConfigError as e:
        print(f"rlbus {role}: {e}", file=sys.stderr)
        return CONFIG_EXIT_CODE
    if dry_run:
        print(dump_json(config))
        return dry_run_checks(role, config)
    if config is not None and config.stage and role not in STAGED_ROLES:
        print(f"rlbus {role}: this config has [[stage]]s, which `rlbus run` runs one after another; give this role "
              f"one stage's config (`rlbus run` writes it to {config.stage[0].config.run.output_dir}/"
              "config.resolved.toml)", file=sys.stderr)
        return CONFIG_EXIT_CODE
    configure_logging(config.log if config is not None else None)
    try:
        return int(load_role(role)(config, role_args) or 0)
    except (ConfigError, RedisNotInstalledError) as e:
        print(f"rlbus {role}: {e}", file=sys.stderr)
        return CONFIG_EXIT_CODE
    except KeyboardInterrupt:
        return 130


def entry() -> NoReturn:
    """The ``rlbus`` program (and ``python -m workers.cli``): :func:`main`, then the exit. The objects the role
    built are frozen out of the collector first: the interpreter's last collections, freeing what the process is
    about to drop anyway, took ~0.5 s of every worker that imported torch, once per tier of a run's shutdown."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
