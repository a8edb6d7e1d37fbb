"""rlbus slurm: the config the job's workers read, --dry-run, and the errors before anything is submitted."""

from pathlib import Path

import pytest

from bus.errors import ConfigError
from tests.paths import REPO
from workers.cli import main as cli_main
from workers.config import RlbusConfig
from workers.tools.slurm import job_config, main


def test_the_job_config_keeps_a_url_password_out_and_resumes_from_checkpoints():
    config = RlbusConfig.model_validate({"redis": {"url": "redis://:s3cret@redis.internal:6380/2"}})
    data = job_config(config)
    assert data["redis"] == {"url": "redis://redis.internal:6380/2", "password_var": "RLBUS_REDIS_PASSWORD"}
    assert data["ckpt"]["resume_step"] == -1


def test_dry_run_prints_the_script_and_the_config_and_submits_nothing(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text(f'[run]\noutput_dir = "{tmp_path / "out"}"\n[slurm]\nnodes = 2\n')
    assert cli_main(["slurm", "@", str(config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash\n#SBATCH --job-name=rlbus-default\n")
    assert f"# {tmp_path / 'out'}/slurm/config.toml, which every worker reads:" in out
    assert not (tmp_path / "out").exists()


def test_resume_needs_a_submitted_run_and_a_rollout_job_needs_a_running_one(tmp_path):
    config = RlbusConfig.model_validate({"run": {"output_dir": str(tmp_path / "out")}})
    with pytest.raises(ConfigError, match="holds no run submitted by rlbus slurm"):
        main(config, ["--resume"])
    with pytest.raises(ConfigError, match="no run job has started"):
        main(config, ["--role", "rollout", "--count", "2"])
    assert not Path(tmp_path / "out").exists()


def test_the_docs_show_the_script_rlbus_slurm_writes(tmp_path, monkeypatch, capsys):
    """docs/slurm.md's GPU layout and its dry-run are what this code writes (regenerate the page's script block)."""
    page = (REPO / "docs" / "slurm.md").read_text()
    layer = tmp_path / "cluster.toml"
    layer.write_text(page.split("```toml\n", 1)[1].split("\n```", 1)[0])
    monkeypatch.chdir("/home")
    assert cli_main(["slurm", "@", str(REPO / "configs" / "default.toml"), "@", str(layer), "--dry-run"]) == 0
    script = capsys.readouterr().out.split("\n# /shared/runs/")[0].rstrip("\n")
    assert f"```bash\n{script}\n```" in page
