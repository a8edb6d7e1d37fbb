"""rlbus run's session without a whole run: config errors stop it before anything starts; its metrics port."""

import socket
import subprocess
import sys
import urllib.request

from tests.paths import REPO
from workers.config import RlbusConfig
from workers.run.session import RunSession


def run_fails(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workers.cli", "run", "@", str(REPO / "configs" / "default.toml"),
                           *flags], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_an_unknown_env_id_stops_the_run_before_anything_starts(tmp_path):
    out = tmp_path / "out"
    proc = run_fails("--env.0.id", "no_such_env", "--run.output_dir", str(out))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "env.0" in lines[0] and "unknown env id 'no_such_env'" in lines[0] and "echo_chars" in lines[0]
    assert not out.exists()


def test_sft_from_references_of_an_env_without_any_stops_before_anything_starts(tmp_path):
    out = tmp_path / "out"
    proc = run_fails("--env.0.mode", "sft", "--env.0.sft_source", "reference", "--env.0.group_size", "1",
                     "--run.output_dir", str(out))
    assert proc.returncode == 2 and "env 'echo_chars' has no reference answers" in proc.stderr, proc.stderr
    assert not out.exists()


def test_a_model_inside_the_state_a_fresh_run_clears_is_refused(tmp_path):
    out = tmp_path / "out"
    (out / "weights" / "step_60").mkdir(parents=True)
    proc = run_fails("--run.output_dir", str(out), "--model.path", str(out / "weights" / "step_60"))
    assert proc.returncode == 2 and "lies in this run's weights/, which a fresh run clears" in proc.stderr, proc.stderr
    assert (out / "weights" / "step_60").exists()


def test_a_teacher_folder_that_is_not_there_is_one_line_naming_the_fix(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "workers.cli", "run", "@", str(REPO / "configs" / "opd.toml"),
                           "--teacher.path", str(tmp_path / "no_teacher"), "--run.output_dir", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"teacher.path='{tmp_path / 'no_teacher'}' does not exist" in proc.stderr
    assert "rlbus init-model --out" in proc.stderr and not out.exists()


def test_the_metrics_port_falls_back_to_a_free_one_when_taken_and_is_printed(tmp_path, redis_url, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = RlbusConfig.model_validate({"run": {"name": "ports", "output_dir": str(tmp_path)},
                                             "exporter": {"port": port, "host": "127.0.0.1"}})
        session = RunSession(config, resume=False, attach=False, grace_s=1, health_timeout_s=1)
        session.start_exporter(redis_url)
        try:
            printed = capsys.readouterr().out
            served = int(printed.split("http://127.0.0.1:")[1].split("/")[0])
            assert served != port and printed.endswith("/metrics (Prometheus)\n")
            with urllib.request.urlopen(f"http://127.0.0.1:{served}/metrics", timeout=10) as response:
                assert 'rlbus_inflight_samples{run="ports"}' in response.read().decode()
        finally:
            session.exporter.stop()


def test_a_run_with_an_env_on_tcp_makes_curve_keys_for_it(tmp_path, capsys):
    config = RlbusConfig.model_validate({"run": {"name": "keys", "output_dir": str(tmp_path)},
                                         "env": [{"id": "echo_chars", "address": "tcp://127.0.0.1:5555"}]})
    session = RunSession(config, resume=False, attach=False, grace_s=1, health_timeout_s=1)
    session.secure_envs()
    folder = tmp_path.resolve() / "curve"
    assert config.rollout.curve_dir == str(folder) and (folder / "client.secret").stat().st_mode & 0o777 == 0o600
    assert f"--curve-dir {folder}" in capsys.readouterr().out
    plain = RlbusConfig.model_validate({"run": {"name": "plain", "output_dir": str(tmp_path / "p")}})
    RunSession(plain, resume=False, attach=False, grace_s=1, health_timeout_s=1).secure_envs()
    assert plain.rollout.curve_dir is None and not (tmp_path / "p" / "curve").exists()
