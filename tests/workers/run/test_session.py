"""rlbus run's session without a whole run: config errors stop it before anything starts."""

import subprocess
import sys

from tests.paths import REPO


def test_an_unknown_env_id_stops_the_run_before_anything_starts(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "workers.cli", "run", "@", str(REPO / "configs" / "default.toml"),
         "--env.0.id", "no_such_env", "--run.output_dir", str(out)],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "env.0" in lines[0] and "unknown env id 'no_such_env'" in lines[0] and "echo_chars" in lines[0]
    assert not out.exists()
