"""``rlbus slurm @ cfg.toml [--dry-run] [--resume] [--role rollout --count N]``: a run on a Slurm cluster.

Writes ``run.output_dir/slurm/config.toml`` (the config every worker of the job reads) and a batch script
(:mod:`workers.tools.slurm_script`), then submits it with ``sbatch``. ``--dry-run`` prints both and submits
nothing. A fresh run clears the run's state in ``run.output_dir`` as ``rlbus run`` does; ``--resume`` keeps it
(Redis's AOF, checkpoints, metrics) and the job continues the run. ``--role rollout --count N`` submits a job of
N more rollout workers for the run already going; ``scancel`` of that job takes them away again.
``run.output_dir`` must be on a file system every node shares.
"""

import argparse
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bus.config import split_password
from bus.errors import ConfigError
from workers.config import RlbusConfig
from workers.run.checks import missing_local_folder
from workers.run.resolved import dump_toml
from workers.run.session import RUN_STATE
from workers.tools.slurm_script import PASSWORD_VAR, rollout_script, run_script


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rlbus slurm", description="Submit a run (or more rollout workers) "
                                     "to Slurm; the layout comes from [slurm].")
    parser.add_argument("--role", choices=("run", "rollout"), default="run",
                        help="run: the whole run (default); rollout: a job of --count more rollout workers")
    parser.add_argument("--count", type=int, default=1, help="rollout workers of a --role rollout job")
    parser.add_argument("--resume", action="store_true", help="continue the run in run.output_dir")
    parser.add_argument("--dry-run", action="store_true", help="print the batch script and config; submit nothing")
    args = parser.parse_args(argv)
    if args.count < 1:
        raise ConfigError(f"--count {args.count}: a rollout job needs at least 1 worker")
    return args


def job_config(config: RlbusConfig) -> dict:
    """What every worker of the job reads: the config with paths absolute, a URL password left out (it travels
    in :data:`PASSWORD_VAR`), and ``ckpt.resume_step = -1`` so a requeued trainer continues from its checkpoint."""
    data = config.model_dump(mode="json", exclude_unset=True)
    data.setdefault("run", {})["output_dir"] = str(Path(config.run.output_dir).resolve())
    if Path(config.model.path).exists() or missing_local_folder(config.model.path):  # a folder, not a hub id
        data.setdefault("model", {})["path"] = str(Path(config.model.path).resolve())
    if config.redis.url is not None:
        url, password = split_password(config.redis.url)
        data.setdefault("redis", {})["url"] = url
        if password is not None and config.redis.password_var is None:
            data["redis"]["password_var"] = PASSWORD_VAR
    if config.ckpt.resume_step is None:
        data.setdefault("ckpt", {})["resume_step"] = -1
    return data


def sbatch_env(config: RlbusConfig) -> dict[str, str]:
    """The submitter's environment (Slurm hands it to the job), with a password that was in ``redis.url``."""
    env = dict(os.environ)
    if config.redis.url is not None:
        _, password = split_password(config.redis.url)
        if password is not None and config.redis.password_var is None:
            env[PASSWORD_VAR] = password
    return env


def prepare(out: Path, config: RlbusConfig, resume: bool) -> None:
    """A fresh run clears the run's state (refusing nothing: ``rlbus run`` does the same); a resumed one needs it."""
    if resume and not (out / "slurm" / "config.toml").exists():
        raise ConfigError(f"--resume: {out} holds no run submitted by rlbus slurm; submit it without --resume")
    if not resume:
        for name in (*RUN_STATE, "slurm"):
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    (out / "slurm" / "logs").mkdir(parents=True, exist_ok=True)
    password = out / "slurm" / "redis.password"
    if config.redis.url is None and not password.exists():
        password.write_text(secrets.token_urlsafe(24))
        password.chmod(0o600)


def submit(script: Path, env: dict[str, str]) -> str:
    """``sbatch`` the script; the job id."""
    if shutil.which("sbatch") is None:
        raise ConfigError("sbatch is not on PATH: run rlbus slurm on a Slurm login node (or use --dry-run)")
    done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise ConfigError(f"sbatch refused {script}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0]


def main(config: RlbusConfig, argv: list[str]) -> int:
    args = parse_args(argv)
    if config.stage:
        raise ConfigError("rlbus slurm submits one run; this config has [[stage]]s: submit each stage's config")
    out, workdir = Path(config.run.output_dir).resolve(), Path.cwd()
    data = job_config(config)
    job = RlbusConfig.model_validate(data)
    init_model = missing_local_folder(config.model.path) and config.model.init_preset is not None
    tag = f"j{time.strftime('%H%M%S')}"
    text = (run_script(job, out, workdir, init_model=init_model) if args.role == "run"
            else rollout_script(job, out, workdir, args.count, tag))
    if args.dry_run:
        print(text)
        print(f"# {out}/slurm/config.toml, which every worker reads:\n{dump_toml(data)}")
        return 0
    if args.role == "run":
        prepare(out, config, args.resume)
    elif not (out / "slurm" / "endpoints.env").exists():
        raise ConfigError(f"no run job has started for {out} yet (no slurm/endpoints.env); submit the run first "
                          "with `rlbus slurm @ cfg.toml` and add rollout workers once it runs")
    if args.role == "run":
        (out / "slurm" / "config.toml").write_text(dump_toml(data))
    script = out / "slurm" / ("run.sbatch" if args.role == "run" else f"rollout-{tag}.sbatch")
    script.write_text(text)
    job_id = submit(script, sbatch_env(config))
    (out / "slurm" / f"{args.role}.job").write_text(job_id + "\n")
    print(f"submitted job {job_id} ({args.role}{f' × {args.count}' if args.role == 'rollout' else ''}): "
          f"{script}; logs in {out}/slurm", file=sys.stderr)
    print(job_id)
    return 0
