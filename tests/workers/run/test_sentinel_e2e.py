"""`rlbus run` against Redis behind Sentinel: the primary is killed -9 mid-run, the replica is promoted, every
worker reconnects to it and the run reaches max_steps with its books balanced."""

import pytest

from tests.sentinels import SentinelCluster
from tests.workers.run.test_session_e2e import (
    assert_counts_add_up,
    start_run,
    stdout_of,
    summary,
    wait_exit,
    wait_step,
)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_survives_the_loss_of_its_redis_primary(tmp_path, tiny_model_dir):
    cluster = SentinelCluster(tmp_path / "redis").start()
    try:
        out = tmp_path / "run"
        proc = start_run(out, tiny_model_dir, "--redis.url", cluster.url, "--redis.wait_replicas", "1",
                         "--run.max_steps", "16", "--eval.interval", "8", "--ckpt.interval", "4")
        wait_step(proc, out, 5, timeout_s=180)
        assert cluster.fail_over() == "b"
        assert wait_exit(proc, out, 240) == 0, stdout_of(out)[-4000:]
        done = summary(out)
        assert done["steps_trained"] == 16 and done["stopped_because"] == "max_steps", done
        assert_counts_add_up(done["groups"])
    finally:
        cluster.stop()
