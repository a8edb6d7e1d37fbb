"""The trainer worker against a real redis-server: steps, weights events, versions, resume, 2 ranks."""

import asyncio

import pytest
import torch

from bus.archive import archived_steps
from bus.errors import ConfigError, RlbusError
from bus.keys import Keys
from bus.messages import Metric, MicroBatch, PolicyVersion, WeightUpdate
from bus.weight_files import verify_weights
from tests.trainer.helpers import save_tiny_model, step_batches
from trainer.weights import read_weights
from trainer.worker import TrainerWorker, main
from workers.config import RlbusConfig
from workers.lifecycle import run_worker
from workers.tools.replay import replay_archive

torch.set_num_threads(1)


def make_config(redis_url, run_name, out, model_dir, **sections):
    base = {
        "run": {"name": run_name, "output_dir": str(out), "max_steps": 4},
        "redis": {"url": redis_url, "block_ms": 100},
        "model": {"path": str(model_dir)},
        "trainer": {"lr": 1e-2, "device": "cpu", "keep_weights": 2},
        "ckpt": {"interval": 1},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return RlbusConfig.model_validate(base)


async def publish_steps(bus, steps, count=2, run=None):
    async with bus("packer", run=run) as b:
        for step in steps:
            await b.publish_many(b.keys.batches(step), step_batches(step, count))


async def stream(bus, key_fn, run=None):
    async with bus("reader", run=run) as b:
        return [m for _, m in await b.read_fanout(key_fn(b.keys), "0", count=1000)]


async def train(config):
    await run_worker(TrainerWorker(config))


async def test_resume_matches_straight_run_and_publishes_versions(tmp_path, redis_url, bus, run_name):
    model_dir = save_tiny_model(tmp_path / "model")
    await publish_steps(bus, range(1, 5))
    straight = make_config(redis_url, run_name, tmp_path / "a", model_dir)
    await train(straight)

    policy = await stream(bus, lambda k: k.policy())
    assert [(p.role, p.step) for p in policy if isinstance(p, PolicyVersion)] == [("trained", s) for s in range(5)]
    weights = [w for w in await stream(bus, lambda k: k.weights()) if isinstance(w, WeightUpdate)]
    assert [w.step for w in weights] == [1, 2, 3, 4] and all(w.format == "safetensors" for w in weights)
    verify_weights(weights[-1].dir, weights[-1].files)
    assert sorted(p.name for p in (tmp_path / "a" / "weights").iterdir()) == ["step_3", "step_4"]  # keep_weights=2
    metrics = [m for m in await stream(bus, lambda k: k.metrics()) if isinstance(m, Metric)]
    assert [m.step for m in metrics] == [1, 2, 3, 4] and "loss/rl" in metrics[0].values

    resumed_run = run_name + "-b"
    await publish_steps(bus, range(1, 5), run=resumed_run)
    first = make_config(redis_url, resumed_run, tmp_path / "b", model_dir, run={"max_steps": 2})
    await train(first)
    second = make_config(redis_url, resumed_run, tmp_path / "b", model_dir, ckpt={"resume_step": -1})
    await train(second)
    versions = await stream(bus, lambda k: k.policy(), run=resumed_run)
    assert [p.step for p in versions if isinstance(p, PolicyVersion)] == [0, 1, 2, 2, 3, 4]  # step 2 re-published
    a = read_weights(tmp_path / "a" / "weights" / "step_4")
    b = read_weights(tmp_path / "b" / "weights" / "step_4")
    for name, tensor in a.items():
        assert torch.allclose(tensor, b[name], atol=1e-6, rtol=0), name


async def test_a_damaged_weights_folder_is_rewritten_not_republished_after_a_restart(tmp_path, redis_url, bus,
                                                                                     run_name):
    """The trainer re-publishes its newest weights when it resumes. It used to hash whatever lay in the folder, damage
    included, so the event matched the damage and every server that loaded it failed; now the folder is checked
    against the manifest written with it, and rewritten from the checkpoint (``weights_rewritten``)."""
    from structlog.testing import capture_logs

    model_dir = save_tiny_model(tmp_path / "model")
    await publish_steps(bus, range(1, 4))
    await train(make_config(redis_url, run_name, tmp_path / "r", model_dir, run={"max_steps": 2}))
    folder = tmp_path / "r" / "weights" / "step_2"
    good = {name: t.clone() for name, t in read_weights(folder).items()}  # not a view of the file (mmap)
    shard = next(folder.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a torn write, a bad disk
    with capture_logs() as logs:
        await train(make_config(redis_url, run_name, tmp_path / "r", model_dir, run={"max_steps": 3},
                          ckpt={"resume_step": -1}))
    assert any(e["event"] == "weights_rewritten" and e["step"] == 2 for e in logs)
    republished = [w for w in await stream(bus, lambda k: k.weights()) if isinstance(w, WeightUpdate)]
    event = [w for w in republished if w.step == 2][-1]
    verify_weights(event.dir, event.files)
    for name, tensor in read_weights(event.dir).items():
        assert torch.equal(tensor, good[name]), name


async def test_two_spawned_ranks_match_one_rank(tmp_path, redis_url, bus, run_name):
    model_dir = save_tiny_model(tmp_path / "model")
    await publish_steps(bus, [1], count=4)
    one = make_config(redis_url, run_name, tmp_path / "one", model_dir, run={"max_steps": 1}, ckpt={"interval": None})
    await train(one)
    await publish_steps(bus, [1], count=4, run=run_name + "-2")
    two = make_config(redis_url, run_name + "-2", tmp_path / "two", model_dir, run={"max_steps": 1},
                      ckpt={"interval": None}, trainer={"num_threads": 1})
    assert main(two, ["--nproc", "2"]) == 0
    a = read_weights(tmp_path / "one" / "weights" / "step_1")
    b = read_weights(tmp_path / "two" / "weights" / "step_1")
    for name, tensor in a.items():
        assert torch.allclose(tensor, b[name], atol=1e-5, rtol=0), name


def _follow_broadcast(redis_url, run, out_path):
    """A stand-in inference server: read the first nccl weights event, join the gloo broadcast, save the tensors."""
    torch.set_num_threads(1)
    from bus.config import RedisConfig
    from bus.streams import Bus
    from trainer.broadcast import receive_weights

    async def follow():
        b = await Bus.connect(redis_url, run, RedisConfig(url=redis_url), "server-0")
        try:
            while True:
                for _, event in await b.read_fanout(b.keys.weights(), "0", block_ms=100):
                    if isinstance(event, WeightUpdate):
                        return event
        finally:
            await b.close()

    event = asyncio.run(follow())
    tensors = receive_weights(event, "cpu", timeout_s=60)
    torch.save({"step": event.step, "tensors": tensors}, out_path)


async def test_nccl_transport_broadcasts_to_a_follower_over_gloo(tmp_path, redis_url, bus, run_name):
    import multiprocessing as mp

    from bus.local_redis import free_port

    model_dir = save_tiny_model(tmp_path / "model")
    await publish_steps(bus, [1])
    config = make_config(redis_url, run_name, tmp_path / "out", model_dir, run={"max_steps": 1},
                         trainer={"weight_transport": "nccl", "nccl_port": free_port(), "broadcast_timeout_s": 60})
    follower = mp.get_context("spawn").Process(target=_follow_broadcast,
                                               args=(redis_url, run_name, str(tmp_path / "got.pt")))
    follower.start()
    await train(config)
    follower.join(timeout=60)
    got = torch.load(tmp_path / "got.pt", weights_only=True)
    trained = torch.load(tmp_path / "out" / "checkpoints" / "step_1" / "trainer.pt", weights_only=True)["model"]
    assert got["step"] == 1
    for name, tensor in got["tensors"].items():
        assert torch.equal(tensor, trained["lm." + name]), name
    assert not (tmp_path / "out" / "weights").exists()
    versions = await stream(bus, lambda k: k.policy())
    assert [p.step for p in versions if isinstance(p, PolicyVersion)] == [0, 1]


async def test_prune_keeps_served_steps_and_the_eval_hold(tmp_path, bus, run_name):
    """keep_weights=1 after step 5: steps still served (2) and held for an eval (3) survive the prune."""
    from types import SimpleNamespace

    from bus.log import get_logger
    from bus.policy import PolicyTracker, publish_served
    from bus.state import EVAL_HOLD_FIELD

    for step in range(1, 6):
        (tmp_path / "weights" / f"step_{step}").mkdir(parents=True)
    worker = TrainerWorker.__new__(TrainerWorker)  # only what _prune uses: no model, no process group
    worker.cfg = SimpleNamespace(keep_weights=1, kl_penalty_reference_step=None)
    worker.output_dir, worker.log = tmp_path, get_logger()

    async with bus("trainer") as b:
        worker.bus, worker.tracker = b, PolicyTracker(b)
        await publish_served(b, "server-0", 2)
        await b.state_set(**{EVAL_HOLD_FIELD: 3})
        await worker._prune(5)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["step_2", "step_3", "step_5"]


async def test_a_trainer_resuming_onto_an_empty_redis_restores_the_data_position(tmp_path, redis_url, bus,
                                                                                 run_name, redis_client):
    model_dir = save_tiny_model(tmp_path / "model")
    await publish_steps(bus, range(1, 3))
    state = Keys(run_name).state()
    redis_client.hset(state, mapping={"feeder:cursor:e": 40, "feeder:epoch:e": 2, "eval:done:x": 0, "inflight": 9})
    await train(make_config(redis_url, run_name, tmp_path / "a", model_dir, run={"max_steps": 2}))
    for key in redis_client.scan_iter(match=f"rlbus:{{{run_name}}}:*"):  # Redis lost the run (FLUSHALL, a new volume)
        redis_client.delete(key)
    await publish_steps(bus, range(3, 4))
    await train(make_config(redis_url, run_name, tmp_path / "a", model_dir, ckpt={"resume_step": -1},
                            run={"max_steps": 3}))
    restored = {k.decode(): v.decode() for k, v in redis_client.hgetall(state).items()}
    assert {k: restored[k] for k in ("feeder:cursor:e", "feeder:epoch:e", "eval:done:x", "packer:last_step")} == {
        "feeder:cursor:e": "40", "feeder:epoch:e": "2", "eval:done:x": "0", "packer:last_step": "2"}
    assert "inflight" not in restored and restored["trainer"].endswith("@3")  # counters start over; step 3 trained
    redis_client.hset(state, "run:epoch", "another")  # a Redis holding another run under this name
    with pytest.raises(ConfigError, match="holds another run epoch"):
        await train(make_config(redis_url, run_name, tmp_path / "a", model_dir, ckpt={"resume_step": -1}))


async def test_skip_progress_takes_the_weights_and_starts_the_steps_over(tmp_path, redis_url, bus, run_name):
    model_dir = save_tiny_model(tmp_path / "model")
    await publish_steps(bus, range(1, 3))
    await train(make_config(redis_url, run_name, tmp_path / "a", model_dir, run={"max_steps": 2}))
    trained = read_weights(tmp_path / "a" / "weights" / "step_2")
    worker = TrainerWorker(make_config(redis_url, run_name + "-b", tmp_path / "a", model_dir,
                                       ckpt={"resume_step": -1, "skip_progress": True}))

    await worker.setup()
    try:
        assert worker.step == 0
        state = worker.policy.lm.state_dict()
        for name, tensor in trained.items():  # (tied embeddings are saved once)
            assert torch.equal(state[name], tensor), name  # step_2's weights, at step 0 of the new run
    finally:
        await worker.close()
    assert [p.step for p in await stream(bus, lambda k: k.policy(), run=run_name + "-b")] == [0]


async def test_trained_and_checkpointed_batches_leave_redis_and_the_archive_keeps_them(tmp_path, redis_url,
                                                                                       bus, run_name,
                                                                                       redis_client):
    model_dir = save_tiny_model(tmp_path / "model")
    await publish_steps(bus, range(1, 5))
    config = make_config(redis_url, run_name, tmp_path / "a", model_dir, ckpt={"interval": 2},
                         trainer={"keep_batches": 1, "archive_batches": True})
    await train(config)
    keys = Keys(run_name)
    kept = [s for s in range(1, 5) if redis_client.exists(keys.batches(s))]
    assert kept == [4]  # 1–3: a step old and covered by checkpoint step_4 (interval 2)
    archived = archived_steps(tmp_path / "a" / "batches")
    assert [s for s, _ in archived] == [1, 2, 3, 4]
    copied = replay_archive(redis_client, tmp_path / "a" / "batches", run_name + "-again")
    assert sum(copied.values()) == 4 * 2  # two micro-batches a step
    again = [MicroBatch.from_fields(f) for _, f in redis_client.xrange(Keys(run_name + "-again").batches(2))]
    assert sorted(mb.index for mb in again) == [0, 1] and all(mb.step == 2 for mb in again)


async def test_weights_that_hold_nan_are_never_published(tmp_path, redis_url, bus, run_name):
    model_dir = save_tiny_model(tmp_path / "model")
    worker = TrainerWorker(make_config(redis_url, run_name, tmp_path / "a", model_dir))

    await worker.setup()
    try:
        with torch.no_grad():
            next(worker.policy.parameters())[0, 0] = float("nan")  # a step went wrong past the gradient check
        with pytest.raises(RlbusError, match="weights of step 1 hold NaN or inf"):
            await worker.publish_weights(1)
    finally:
        await worker.close()
    assert await stream(bus, lambda k: k.weights()) == []
    assert [p.step for p in await stream(bus, lambda k: k.policy())] == [0]
    assert not (tmp_path / "a" / "weights" / "step_1").exists()


async def test_a_kl_penalty_against_the_initial_weights_reports_kl_ref(tmp_path, redis_url, bus, run_name):
    model_dir = save_tiny_model(tmp_path / "model")
    await publish_steps(bus, range(1, 4), count=2)
    await train(make_config(redis_url, run_name, tmp_path / "a", model_dir, run={"max_steps": 3},
                      trainer={"kl_penalty_coef": 0.1}))
    metrics = [m.values for m in await stream(bus, lambda k: k.metrics()) if isinstance(m, Metric)]
    assert metrics[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # step 1 trains the initial weights themselves
    assert metrics[2]["kl_ref"] != 0.0  # two updates later the policy has moved away from them
    with pytest.raises(ConfigError, match="kl_penalty_reference_step=99"):
        await train(make_config(redis_url, run_name + "-b", tmp_path / "b", model_dir,
                          trainer={"kl_penalty_coef": 0.1, "kl_penalty_reference_step": 99}))
