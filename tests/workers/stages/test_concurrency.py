"""The AIMD controller on synthetic loads, and the servers' answers it reads (workers/stages/server_load.py)."""

from workers.concurrency_config import ConcurrencyConfig
from workers.stages.concurrency import AimdController
from workers.stages.server_load import Load, Reading, combine, from_health, from_prometheus

CFG = ConcurrencyConfig(adaptive=True, floor=2, ceiling=6)
IDLE = Load(waiting=0, use=0.1, token_s=0.01)


def test_grows_by_one_per_interval_with_headroom_up_to_the_ceiling():
    c = AimdController(CFG, start=2)
    limits = []
    for _ in range(8):
        c.update(IDLE, in_use=c.limit)
        limits.append(c.limit)
    assert limits == [3, 4, 5, 6, 6, 6, 6, 6]


def test_an_unused_limit_is_not_raised():
    c = AimdController(CFG, start=3)
    assert c.update(IDLE, in_use=1) is None and c.limit == 3


def test_cuts_when_the_queue_grows_down_to_the_floor():
    c = AimdController(CFG, start=6)
    c.update(Load(waiting=1, use=0.5), in_use=6)  # waiting, first seen: hold
    assert c.limit == 6
    assert c.update(Load(waiting=5, use=0.5), in_use=6) == "queue_growing" and c.limit == 4  # int(6 * 0.7)
    c.update(Load(waiting=9), in_use=4)
    assert c.limit == 2  # at least -1: 3, and here int(4 * 0.7) = 2
    c.update(Load(waiting=20), in_use=2)
    assert c.limit == 2  # the floor
    c.update(Load(waiting=20), in_use=2)
    assert c.limit == 2  # a steady queue: hold, no growth


def test_cuts_on_preemptions_and_on_latency_past_its_factor():
    c = AimdController(CFG, start=6)
    assert c.update(Load(waiting=0, use=0.5, preemptions=2), in_use=6) == "preemptions" and c.limit == 4
    c.update(Load(waiting=0, use=0.5, token_s=0.010), in_use=4)  # headroom: 5
    assert c.update(Load(waiting=0, use=0.5, token_s=0.025), in_use=5) == "latency" and c.limit == 3
    c.update(Load(waiting=0, use=0.5, token_s=0.016), in_use=3)  # 1.6x its best: neither grows nor cuts
    assert c.limit == 3


def test_full_batch_slots_stop_growth():
    c = AimdController(CFG, start=3)
    assert c.update(Load(waiting=0, use=0.95), in_use=3) is None and c.limit == 3


def test_holds_when_no_server_answers():
    c = AimdController(CFG, start=4)
    assert c.update(None, in_use=4) is None and c.limit == 4


def test_start_is_clamped_to_floor_and_ceiling():
    assert AimdController(CFG, start=1).limit == 2 and AimdController(CFG, start=99).limit == 6


def test_readings_of_the_builtin_server_and_of_vllm():
    health = {"status": "ok", "active": 32, "queued": 3, "max_batch_size": 64, "steps": 100, "decode_s": 2.0}
    assert from_health(health) == Reading(waiting=3, use=0.5, decode_s=2.0, steps=100)
    text = "\n".join([
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{model_name="m",engine="0"} 4.0',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.75',
        "# TYPE vllm:num_preemptions counter",
        'vllm:num_preemptions_total{model_name="m",engine="0"} 7.0',
        "# TYPE vllm:time_per_output_token_seconds histogram",
        'vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 50.0',
        'vllm:time_per_output_token_seconds_count{model_name="m"} 50.0',
        'vllm:time_per_output_token_seconds_sum{model_name="m"} 1.5', ""])
    assert from_prometheus(text) == Reading(waiting=4, use=0.75, preemptions=7.0, decode_s=1.5, steps=50.0)


def test_combined_load_sums_queues_and_takes_the_worst_server():
    a0, a1 = Reading(1, 0.2, 3.0, 1.0, 100), Reading(2, 0.4, 5.0, 2.0, 200)  # 0.01 s/token
    b0, b1 = Reading(0, 0.7, 0.0, 0.0, 0), Reading(0, 0.9, 0.0, 3.0, 100)  # 0.03 s/token
    assert combine([(a1, a0), (b1, b0)]) == Load(waiting=2, use=0.9, preemptions=2, token_s=0.03)
    assert combine([(a1, None)]) == Load(waiting=2, use=0.4)  # a first answer: no change to count yet
