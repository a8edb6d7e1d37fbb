"""The batch scripts of rlbus slurm: where each role lands, what the script hands every worker, and that bash
accepts it."""

import subprocess
from pathlib import Path

import pytest

from bus.errors import ConfigError
from workers.config import RlbusConfig
from workers.tools.slurm_script import place, rollout_script, run_script

OUT, WORKDIR = Path("/shared/runs/r"), Path("/home/me/rl")


def gpu_config(**slurm) -> RlbusConfig:
    """The docs' layout: 2 nodes of 8 GPUs, a 6-GPU trainer, 10 inference servers."""
    return RlbusConfig.model_validate({
        "run": {"name": "r", "output_dir": str(OUT)}, "trainer": {"nproc": 6},
        "inference": {"backend": "vllm", "servers": 10}, "rollout": {"workers": 4}, "filter": {"workers": 2},
        "slurm": {"nodes": 2, "gpus_per_node": 8, "partition": "gpu", "account": "rl", "time": "1-00:00:00",
                  "prelude": ["module load cuda"], "sbatch": ["--constraint=h100"], **slurm}})


def test_the_trainer_takes_the_first_gpus_and_servers_fill_the_rest():
    launches = {launch.name: launch for launch in place(gpu_config())}
    assert (launches["trainer"].node, launches["trainer"].gpus) == (0, (0, 1, 2, 3, 4, 5))
    assert launches["trainer"].options == ("--nproc", "6")
    servers = [launches[f"inference-{i}"] for i in range(10)]
    assert [(s.node, s.gpus, s.port) for s in servers[:3]] == [(0, (6,), 8000), (0, (7,), 8001), (1, (0,), 8000)]
    assert [s.node for s in servers[2:]] == [1] * 8 and servers[-1].gpus == (7,)
    every_gpu = [(launch.node, g) for launch in launches.values() for g in launch.gpus]
    assert sorted(every_gpu) == [(n, g) for n in range(2) for g in range(8)]  # each GPU exactly once
    assert {launches[f"rollout-{i}"].node for i in range(4)} == {0, 1}
    assert launches["feeder"].after_servers and launches["rollout-0"].after_servers
    assert not launches["trainer"].after_servers


def test_a_layout_that_does_not_fit_names_the_numbers():
    with pytest.raises(ConfigError, match="inference.servers=11"):
        place(gpu_config().model_copy(update={"inference": gpu_config().inference.model_copy(update={"servers": 11})}))
    with pytest.raises(ConfigError, match="trainer's 12 GPUs"):
        place(gpu_config(trainer_gpus=12))


def test_a_cpu_run_puts_gpu_roles_on_the_first_node_and_spreads_rollouts():
    config = RlbusConfig.model_validate({"rollout": {"workers": 3}, "slurm": {"nodes": 3}})
    launches = {launch.name: launch for launch in place(config)}
    assert launches["trainer"].gpus == () and launches["trainer"].node == 0
    assert [launches[f"rollout-{i}"].node for i in range(3)] == [2, 1, 0]
    assert launches["filter-0"].node == 2


def test_the_run_script_asks_slurm_and_finds_everything_from_the_node_list():
    script = run_script(gpu_config(), OUT, WORKDIR, init_model=False)
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu", "#SBATCH --account=rl",
                 "#SBATCH --time=1-00:00:00", "#SBATCH --exclusive", "#SBATCH --requeue", "#SBATCH --constraint=h100",
                 f"#SBATCH --chdir={WORKDIR}", "module load cuda"):
        assert line + "\n" in script, line
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in script
    assert 'REDIS_URL="redis://${ADDR[0]}:6379/0"' in script and "--requirepass" not in script  # not in ps
    assert '\\"http://${ADDR[1]}:8007/v1\\"' in script
    assert 'step 0 trainer "0,1,2,3,4,5" trainer --nproc 6 "${COMMON[@]}"' in script
    assert 'step 1 inference-9 "7" inference --host 0.0.0.0 --port 8007 --server-id inference-9' in script
    assert script.index("step 0 trainer") < script.index("/health") < script.index("step 0 feeder")
    assert '"${RLBUS[@]}" run "${COMMON[@]}" --attach' in script
    assert "10.0." not in script and "localhost" not in script  # no host written in


def test_an_existing_redis_is_used_without_its_password_in_the_script():
    config = gpu_config().model_copy(update={"redis": RlbusConfig().redis.model_copy(
        update={"url": "redis://redis.internal:6380/2"})})
    script = run_script(config, OUT, WORKDIR, init_model=False)
    assert "REDIS_URL=redis://redis.internal:6380/2" in script and "redis-server" not in script


def test_a_rollout_job_reads_the_runs_endpoints_and_restarts_its_workers():
    script = rollout_script(gpu_config(rollout_nodes=2), OUT, WORKDIR, 3, "j1")
    assert "#SBATCH --nodes=2\n" in script and "--exclusive" not in script and "--gpus-per-node" not in script
    assert 'source "$OUT/slurm/endpoints.env"' in script
    assert '--consumer "rollout-j1-$1" && break' in script
    assert "for i in $(seq 0 2)" in script


@pytest.mark.parametrize("which", ["run", "rollout"])
def test_bash_parses_the_scripts(tmp_path, which):
    text = (run_script(gpu_config(), OUT, WORKDIR, init_model=True) if which == "run"
            else rollout_script(gpu_config(), OUT, WORKDIR, 2, "j1"))
    (tmp_path / "job.sh").write_text(text)
    done = subprocess.run(["bash", "-n", str(tmp_path / "job.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
