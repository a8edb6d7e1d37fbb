"""The `rlbus` command: role list, lazy imports, `inspect` against a live server, `redis` in the foreground."""

import json
import signal
import subprocess
import sys

import redis

from bus.messages import Metric, Task
from tests.paths import REPO
from workers import cli


def rlbus(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_every_role_without_importing_torch():
    code = "import sys; from workers.cli import main; main(['--help']); assert 'torch' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for role in cli.ROLES:
        assert f"  {role} " in done.stdout


def test_dry_run_imports_no_role_module():
    code = (
        "import sys; from workers.cli import main; rc = main(['trainer', '--dry-run']);"
        "assert rc == 0 and 'torch' not in sys.modules and 'trainer.worker' not in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_run_dry_run_stops_where_run_would_at_start_with_one_line(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('[[env]]\nid = "nope-x"\n')
    done = rlbus("run", "@", str(config), "--dry-run")
    assert done.returncode == 2 and done.stderr.startswith("rlbus run: env.0 ('nope-x'): unknown env id 'nope-x'; ")
    # The config is printed all the same.
    assert len(done.stderr.strip().splitlines()) == 1 and '"nope-x"' in done.stdout
    done = rlbus("run", "--dry-run")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "rlbus run: no [[env]] configured; a run needs at least one training env (an [[env]] with an id)"]


def test_run_dry_run_passes_a_config_that_starts_without_importing_torch():
    quickstart = str(REPO / "configs" / "quickstart.toml")
    code = (f"import sys; from workers.cli import main; rc = main(['run', '@', {quickstart!r}, "
            "'--dry-run']); assert rc == 0 and 'torch' not in sys.modules and 'workers.run.session' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_unknown_role():
    done = rlbus("trainr")
    assert done.returncode == 2 and "unknown role 'trainr'" in done.stderr


def test_a_role_given_a_config_with_stages_names_the_stage_config_to_give_it():
    done = rlbus("trainer", "@", str(REPO / "configs" / "quickstart.toml"))
    assert done.returncode == 2 and "outputs/quickstart/sft/config.resolved.toml" in done.stderr, done.stderr


def test_role_gets_config_and_undotted_options(monkeypatch):
    seen = {}

    def fake_role(config, argv):
        seen.update(config=config, argv=argv)
        return 3

    monkeypatch.setattr(cli, "load_role", lambda role: fake_role)
    assert cli.main(["packer", "--packer.seq_len", "64", "--consumer", "p1"]) == 3
    assert seen["config"].packer.seq_len == 64 and seen["argv"] == ["--consumer", "p1"]
    assert cli.main(["inspect", "--run", "x"]) == 3
    assert seen["config"] is None and seen["argv"] == ["--run", "x"]


async def fill_run(bus):
    async with bus("w1") as b:
        stream = b.keys.tasks("e")
        await b.publish_many(
            stream,
            [Task(task_id=f"e:0:{i}", env="e", example_index=i, example_id=str(i), group_size=2) for i in range(5)],
        )
        await b.read_group([stream], "rollout", count=2)
        await b.redis.xadd(stream, {"kind": "task", "v": "1", "data": b"junk"})
        await b.publish(b.keys.metrics(), Metric(source="trainer", step=1, values={"loss": 0.5}))
        await b.state_set(inflight=4)


async def test_inspect_json_against_a_live_server(bus, redis_url, run_name):
    await fill_run(bus)
    done = rlbus("inspect", "--run", run_name, "--redis-url", redis_url, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["run"] == run_name and report["state"] == {"inflight": "4"}
    streams = {s["name"]: s for s in report["streams"]}
    assert set(streams) == {"tasks:e", "metrics"}
    tasks = streams["tasks:e"]
    assert tasks["length"] == 6 and tasks["key"] == f"rlbus:{{{run_name}}}:tasks:e"
    (group,) = tasks["groups"]
    assert group["name"] == "rollout" and group["pending"] == 2 and group["lag"] == 4
    assert group["consumers"] == [{"name": "w1", "pending": 2, "idle_ms": group["consumers"][0]["idle_ms"]}]
    assert group["oldest_pending_age_s"] >= 0 and group["oldest_pending_idle_ms"] >= 0

    table = rlbus("inspect", "--run", run_name, "--redis-url", redis_url)
    assert table.returncode == 0 and "tasks:e" in table.stdout and "rollout" in table.stdout


async def test_inspect_tail_decodes_entries(bus, redis_url, run_name):
    await fill_run(bus)
    done = rlbus("inspect", "--run", run_name, "--redis-url", redis_url, "--json", "--tail", "2", "--stream", "tasks:e")
    assert done.returncode == 0, done.stderr
    first, last = json.loads(done.stdout)["entries"]
    assert first["headers"]["kind"] == "task" and first["message"]["task_id"] == "e:0:4"
    assert "decode_error" in last["message"]
    missing = rlbus("inspect", "--run", run_name, "--redis-url", redis_url, "--tail", "1", "--stream", "nope")
    assert missing.returncode == 2 and "has no stream 'nope'" in missing.stderr


def test_redis_role_runs_in_the_foreground_until_ctrl_c(tmp_path):
    with subprocess.Popen([sys.executable, "-m", "workers.cli", "redis", "--port", "0", "--dir", str(tmp_path)],
                          stdout=subprocess.PIPE, text=True) as proc:
        try:
            url = proc.stdout.readline().strip()
            assert url.startswith("redis://127.0.0.1:")
            assert redis.Redis.from_url(url).ping()
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=20) == 0
        finally:
            proc.kill()
