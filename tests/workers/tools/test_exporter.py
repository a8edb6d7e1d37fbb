"""The exporter's figures from a run written by hand, entry ids included, so every value is known: stream and group
figures, counters from the metrics and dead streams, policy versions, per-hop latency, staleness, weight-update
latency; and `rlbus exporter` serving them over HTTP."""

import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bus.local_redis import free_port
from bus.messages import DeadLetter, Metric, PolicyVersion, RolloutGroup, Sample, Task
from bus.state import INFLIGHT_FIELD, STOP_REASON_FIELD
from tests.paths import REPO
from workers.config import RlbusConfig
from workers.stages.packing import pack_step
from workers.tools.exporter import Exporter

ENV = "rev"
TASK = f"{ENV}:0:7"


def config(redis_url: str, run_name: str) -> RlbusConfig:
    return RlbusConfig.model_validate({"run": {"name": run_name}, "redis": {"url": redis_url},
                                       "env": [{"id": "reverse_text", "name": ENV, "group_size": 2}],
                                       "packer": {"max_off_policy_steps": 2}})


def group(total_s: float) -> RolloutGroup:
    samples = [Sample(prompt_ids=np.arange(3, dtype=np.int32), completion_ids=np.arange(4, dtype=np.int32),
                      completion_logprobs=np.full(4, -1.0, np.float32), loss_mask=np.ones(4, bool), reward=r,
                      policy_version_start=0, policy_version_end=0) for r in (0.0, 1.0)]
    return RolloutGroup(task_id=TASK, env=ENV, example_id="7", example_index=7, samples=samples,
                        timings={"total_s": total_s})


def write_run(client, keys) -> None:
    """One task's path through the hops at known milliseconds, the step's metrics, a dead letter, a group."""
    task = Task(task_id=TASK, env=ENV, example_index=7, example_id="7", group_size=2)
    client.xadd(keys.tasks(ENV), task.to_fields(), id="1000-0")
    client.xadd(keys.rollouts(ENV), group(1.5).to_fields(), id="3000-0")   # queued 0.5 s, generating 1.5 s
    client.xadd(keys.filtered(ENV), group(1.5).to_fields(), id="3200-0")   # filtering 0.2 s
    batches, _ = pack_step(group(1.5).samples, step=1, seq_len=32, dp_size=1)
    for i, mb in enumerate(batches):
        client.xadd(keys.batches(1), mb.to_fields(), id=f"4000-{i}")        # packing 0.8 s
    client.xadd(keys.policy(), PolicyVersion(role="trained", step=1).to_fields(), id="4500-0")  # training 0.5 s
    client.xadd(keys.policy(), PolicyVersion(role="served", step=1, server="s0").to_fields(), id="5250-0")
    for metric in (Metric(source="rollout", values={"rollout/train_groups": 1.0, "tokens_generated": 8.0}),
                   Metric(source="packer", step=1, values={"packer/groups": 1.0, "packer/reward_mean": 0.5,
                                                           "packer/stale_groups": 2.0, "packer/tokens": 14.0}),
                   Metric(source="trainer", step=1, values={"tokens": 14.0, "wait_s": 2.0, "step_time_s": 0.25,
                                                            "tokens_per_s": 56.0}),
                   Metric(source="eval", step=0, values={f"eval/{ENV}/reward": 0.75, f"eval/{ENV}/pass@1": 0.5})):
        client.xadd(keys.metrics(), metric.to_fields())
    for reason in ("decode: not msgpack", "decode: truncated", "TimeoutError: the rollout took longer"):
        client.xadd(keys.dead(), DeadLetter(stream=keys.tasks(ENV), entry_id="1-0", reason=reason).to_fields())
    client.hset(keys.state(), INFLIGHT_FIELD, 6)
    client.xgroup_create(keys.tasks(ENV), "rollout", id="0")
    client.xreadgroup("rollout", "rollout-0", {keys.tasks(ENV): ">"}, count=1)


def samples(registry) -> dict[tuple, float]:
    """(sample name, frozenset of its labels but run) → value."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "run"}
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def value(found: dict, name: str, **labels) -> float:
    return found[(name, frozenset(labels.items()))]


def test_the_figures_of_a_run_written_by_hand(redis_url, run_name, redis_client):
    cfg = config(redis_url, run_name)
    exporter = Exporter(cfg, redis_url)
    keys = exporter.collector.keys
    write_run(redis_client, keys)
    try:
        assert exporter.collector.follower.poll() > 0
        found = samples(exporter.registry)
    finally:
        exporter.stop()
    hop = "rlbus_hop_latency_seconds"
    assert {h: value(found, f"{hop}_sum", hop=h) for h in ("queued", "generating", "filtering", "packing",
                                                           "training")} == pytest.approx(
        {"queued": 0.5, "generating": 1.5, "filtering": 0.2, "packing": 0.8, "training": 0.5})
    assert value(found, f"{hop}_bucket", hop="queued", le="0.5") == 1
    assert value(found, f"{hop}_bucket", hop="queued", le="0.25") == 0
    assert value(found, "rlbus_weight_update_latency_seconds_sum", server="s0") == pytest.approx(0.75)
    assert value(found, "rlbus_trained_staleness_steps_count") == 2  # both samples, 0 steps behind
    assert value(found, "rlbus_trained_staleness_steps_bucket", le="0") == 2
    assert value(found, "rlbus_trained_staleness_max_steps") == 0
    assert value(found, "rlbus_policy_trained_step") == 1
    assert value(found, "rlbus_policy_served_step", server="s0") == 1
    assert value(found, "rlbus_max_off_policy_steps") == 2
    groups = {o: value(found, "rlbus_groups_total", outcome=o) for o in ("produced", "trained", "stale", "dead")}
    assert groups == {"produced": 1, "trained": 1, "stale": 2, "dead": 3}
    assert value(found, "rlbus_dead_letters_total", stream="tasks", reason="decode") == 2
    assert value(found, "rlbus_dead_letters_total", stream="tasks", reason="TimeoutError") == 1
    assert value(found, "rlbus_tokens_total", stage="generated") == 8
    assert value(found, "rlbus_tokens_total", stage="trained") == 14
    assert value(found, "rlbus_trainer_idle_seconds_total") == 2
    assert value(found, "rlbus_trainer_tokens_per_second") == 56
    assert value(found, "rlbus_train_reward_mean") == 0.5
    assert value(found, "rlbus_eval_reward", env=ENV) == 0.75
    assert value(found, "rlbus_eval_pass_at_1", env=ENV) == 0.5
    assert value(found, "rlbus_inflight_samples") == 6
    assert value(found, "rlbus_run_finished") == 0
    tasks = {"stream": "tasks", "env": ENV, "group": "rollout"}
    assert value(found, "rlbus_stream_length", stream="rollouts", env=ENV) == 1
    assert value(found, "rlbus_group_pending", **tasks) == 1
    assert value(found, "rlbus_group_lag", **tasks) == 0
    assert value(found, "rlbus_group_consumers", **tasks) == 1
    assert value(found, "rlbus_group_pending_max_deliveries", **tasks) == 1
    assert value(found, "rlbus_group_oldest_pending_age_seconds", **tasks) > 1e6  # its id says 1970
    assert value(found, "rlbus_dead_letter_stream_length") == 3


def test_a_second_poll_counts_only_what_is_new_and_a_stop_reason_ends_the_run(redis_url, run_name, redis_client):
    exporter = Exporter(config(redis_url, run_name), redis_url)
    keys = exporter.collector.keys
    try:
        redis_client.xadd(keys.metrics(), Metric(source="packer", step=1, values={"packer/groups": 3.0}).to_fields())
        exporter.collector.follower.poll()
        exporter.collector.follower.poll()
        redis_client.xadd(keys.metrics(), Metric(source="packer", step=2, values={"packer/groups": 4.0}).to_fields())
        exporter.collector.follower.poll()
        assert value(samples(exporter.registry), "rlbus_groups_total", outcome="trained") == 7
        redis_client.hset(keys.state(), STOP_REASON_FIELD, "data exhausted")
        assert value(samples(exporter.registry), "rlbus_run_finished") == 1
    finally:
        exporter.stop()


@pytest.mark.timeout(60)
def test_rlbus_exporter_serves_the_metrics_and_stops_on_sigterm(redis_url, run_name, redis_client):
    port = free_port()
    redis_client.hset(f"rlbus:{{{run_name}}}:state", INFLIGHT_FIELD, 3)
    with subprocess.Popen([sys.executable, "-m", "workers.cli", "exporter", "--run.name", run_name, "--redis.url",
                           redis_url, "--port", str(port)], cwd=REPO, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert f"metrics at http://0.0.0.0:{port}/metrics" in proc.stdout.readline()
            deadline = time.monotonic() + 20
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                        text = response.read().decode()
                    break
                except OSError:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
            assert f'rlbus_inflight_samples{{run="{run_name}"}} 3.0' in text
            proc.terminate()
            assert proc.wait(20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


def test_an_exporter_whose_config_names_no_env_finds_the_runs_streams(redis_url, run_name, redis_client):
    cfg = RlbusConfig.model_validate({"run": {"name": run_name}, "redis": {"url": redis_url}})
    exporter = Exporter(cfg, redis_url)
    write_run(redis_client, exporter.collector.keys)
    try:
        exporter.collector.follower.poll()
        found = samples(exporter.registry)
    finally:
        exporter.stop()
    assert value(found, "rlbus_hop_latency_seconds_sum", hop="queued") == pytest.approx(0.5)
