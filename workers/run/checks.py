"""What ``rlbus run`` checks before it starts a process: an env to train on, every env loads, the models are there,
W&B can log in. Each check raises a one-line :class:`ConfigError` naming the fix."""

import netrc
import os
from pathlib import Path

from bus.errors import ConfigError
from workers.config import RlbusConfig
from workers.env_config import EnvConfig
from workers.envs.registry import load_env
from workers.envs.verifiers_env import ANSWER_FIELD, load_tasks, reference_answer, vf_config_data
from workers.run.hub import fetch_hub_model, is_hub_id
from workers.run.resolved import needs_teacher_server


def missing_local_folder(path: str) -> bool:
    """A path that names a local folder (absolute, relative with ./ or ../, or deeper than a hub's org/name) that
    is not there; ``org/name`` may be a hub id, left to transformers where a hub is reachable."""
    if Path(path).exists():
        return False
    return Path(path).is_absolute() or path.startswith(".") or path.strip("/").count("/") >= 2


def check_models(config: RlbusConfig, *, download: bool = True) -> None:
    """The teacher's folder exists before anything starts (the policy's is built from model.init_preset); a hub id
    (the policy's or the teacher's) is in the hub cache, fetched once here if it is not (unless ``download`` is
    False: then one that could be fetched passes)."""
    teacher = config.teacher.path if config.teacher is not None else None
    served = teacher if needs_teacher_server(config) else None
    for what, path in (("model.path", config.model.path), ("teacher.path", served)):
        if path is not None and is_hub_id(path):
            fetch_hub_model(path, what, download=download)
    if teacher is not None and needs_teacher_server(config) and missing_local_folder(teacher):
        raise ConfigError(f"teacher.path={teacher!r} does not exist; put a teacher there (a trained run's weights "
                          f"folder, or `rlbus init-model --out {teacher}` for a random one to try the pipeline) or "
                          "list running teacher servers in teacher.base_urls")


def check_wandb(config: RlbusConfig) -> None:
    """W&B online has an API key to log in with (``WANDB_API_KEY`` or ``wandb login``'s netrc entry); without one
    ``wandb.init`` stops the run after every worker has started."""
    if config.wandb is None or config.wandb.mode != "online" or os.environ.get("WANDB_API_KEY"):
        return
    try:
        logged_in = netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        logged_in = False
    if not logged_in:
        raise ConfigError("wandb.mode = \"online\" needs a W&B API key and none is configured; set WANDB_API_KEY, "
                          "run `wandb login`, or set wandb.mode = \"offline\"")


def check_has_env(config: RlbusConfig) -> None:
    """A run trains on at least one env (the feeder, filter and packer would each stop on none)."""
    if not config.env:
        raise ConfigError("no [[env]] configured; a run needs at least one training env (an [[env]] with an id)")


def check_envs(config: RlbusConfig) -> dict[str, int]:
    """Load every train and eval env once, in-process, so a bad id or args stops the run before anything starts;
    returns the dataset size of each eval env (the eval coordinator picks its examples from them)."""
    eval_sizes = {}
    for section, envs in (("env", config.env), ("eval.env", config.eval.env)):
        for i, env in enumerate(envs):
            if env.kind == "openenv":
                if section == "eval.env":
                    eval_sizes[env.resolved_name] = env.openenv.num_episodes
                continue
            if env.kind == "verifiers":
                try:
                    tasks = load_tasks(env, vf_config_data(env))
                except ConfigError as e:
                    raise ConfigError(f"{section}.{i} ({env.resolved_name!r}): {e}") from e
                size = len(tasks)
                if env.mode == "sft" and env.sft_source == "reference":
                    check_answers(f"{section}.{i}", env, tasks)
                if section == "eval.env":
                    eval_sizes[env.resolved_name] = size
                continue
            try:
                loaded = load_env(env.id, env.args)
            except ConfigError as e:
                raise ConfigError(f"{section}.{i} ({env.resolved_name!r}): {e}") from e
            if env.mode == "sft" and env.sft_source == "reference" and loaded.reference_fn is None:
                raise ConfigError(f"{section}.{i} ({env.resolved_name!r}): sft_source = \"reference\" but env "
                                  f"{env.id!r} has no reference answers; use an env that has them (dataset, "
                                  "reasoning_gym) or sft_source = \"teacher\"")
            if section == "eval.env":
                eval_sizes[env.resolved_name] = len(loaded)
    return eval_sizes


def check_answers(where: str, env: EnvConfig, tasks: list[dict]) -> None:
    """A verifiers env trained on its reference answers has one in every task."""
    lacking = next((i for i, data in enumerate(tasks) if reference_answer(data) is None), None)
    if lacking is not None:
        raise ConfigError(f"{where} ({env.resolved_name!r}): sft_source = \"reference\" trains on each task's "
                          f"{ANSWER_FIELD!r} field and task {lacking} of taskset {env.taskset['id']!r} has none; give "
                          "its tasks an answer, or use sft_source = \"teacher\"")


def run_problems(config: RlbusConfig, *, download: bool = True) -> list[str]:
    """One line per check above that would stop ``rlbus run`` (what ``--dry-run`` and ``config convert`` report);
    each env is checked on its own, so every env that would not load is named, not only the first."""
    problems = [_problem(check_has_env, config)]
    for section, envs in (("env", config.env), ("eval.env", config.eval.env)):
        for i, env in enumerate(envs):
            alone = config.model_copy(update={
                "env": [env] if section == "env" else [],
                "eval": config.eval.model_copy(update={"env": [env] if section == "eval.env" else []})})
            problem = _problem(check_envs, alone)
            problems.append(problem and problem.replace(f"{section}.0 ", f"{section}.{i} ", 1))
    problems += [_problem(lambda c: check_models(c, download=download), config), _problem(check_wandb, config)]
    return [p for p in problems if p]


def _problem(check, config: RlbusConfig) -> str | None:
    try:
        check(config)
    except ConfigError as e:
        return str(e)
    return None


def dry_run_problems(config: RlbusConfig) -> list[str]:
    """``rlbus run --dry-run``: :func:`run_problems` of the run, or of each ``[[stage]]`` (named), fetching no
    model."""
    if not config.stage:
        return run_problems(config, download=False)
    return [f"stage {stage.name}: {problem}" for stage in config.stage
            for problem in run_problems(stage.config, download=False)]
