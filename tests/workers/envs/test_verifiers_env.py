"""verifiers v1 envs: the config form, the spawned and external env server, episodes → samples token-exactly, and an
env server killed mid-run. The tasksets are this folder's ``vf_tasksets`` packages; the model is served by the
built-in inference server (its ``/inference/v1/generate`` route is what verifiers' train client calls)."""

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from pydantic import ValidationError

from bus.errors import ConfigError, EnvUnavailableError, RpcError
from bus.local_redis import free_port
from tests.paths import REPO
from tests.workers.inference.process import InferenceProcess
from workers.env_config import EnvConfig, SamplingConfig
from workers.envs.verifiers_env import VerifiersHandle, load_tasks, vf_config_data
from workers.inference.client import InferenceClient
from workers.stages.episode import ChatTokens, RolloutError
from workers.stages.traces import VerifiersReferenceRunner, VerifiersRunner, episode_samples

pytest.importorskip("verifiers.v1", reason="needs the verifiers extra: pip install 'rlbus[verifiers]'")

TASKSETS = Path(__file__).parent / "vf_tasksets"


@pytest.fixture(scope="module", autouse=True)
def tasksets_installed():
    """The test tasksets importable here and in every process the tests spawn (as if pip-installed)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(TASKSETS))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(TASKSETS), str(REPO), os.environ.get("PYTHONPATH", "")]))
        yield


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vf-inference")
    config = tmp / "cfg.toml"
    config.write_text(f'[model]\npath = "{tiny_model_dir}"\n[inference]\nnum_threads = 1\nmax_model_len = 512\n')
    with InferenceProcess(config, free_port(), log_path=tmp / "server.log") as proc:
        yield proc


def echo_env(**fields) -> EnvConfig:
    return EnvConfig(taskset={"id": "rlbus-test-echo", "num_tasks": 16}, group_size=4, **fields)


def runner(server, tiny_model_dir) -> tuple[VerifiersRunner, InferenceClient]:
    client = InferenceClient([server.base_url])
    return VerifiersRunner(client, served=lambda: 0, renderer_model=str(tiny_model_dir), api_key_var=None), client


def task(index: int, group_size: int = 4, mode: str = "rl"):
    from bus.messages import Task

    return Task(task_id=f"t:{index}", env="e", example_id=str(index), example_index=index, epoch=0,
                group_size=group_size, mode=mode)


SAMPLING = SamplingConfig(temperature=1.0, max_completion_tokens=6)


def generated_tokens(server) -> float:
    """The inference server's own count of the tokens it has sampled (its Prometheus counter)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("rlbus_inference_generated_tokens_total{"))


def model_spans(loss_mask) -> int:
    """How many runs of model-sampled tokens the completion holds (one per model turn)."""
    mask = loss_mask.astype(int)
    return int(mask[0] + ((mask[1:] - mask[:-1]) == 1).sum())


def test_a_prime_rl_env_block_validates_and_defaults_to_the_in_process_harness():
    env = EnvConfig.model_validate({"taskset": {"id": "rlbus-test-echo", "num_tasks": 5}, "timeout": {"episode": 30},
                                    "pool": {"type": "static", "num_workers": 1}, "group_size": 2})
    assert env.kind == "verifiers" and env.resolved_name == "rlbus-test-echo"
    data = vf_config_data(env)
    assert data["agent"]["harness"]["id"] == "rlbus-chat" and data["agent"]["runtime"]["type"] == "subprocess"
    assert data["timeout"]["episode"] == 30 and data["taskset"]["num_tasks"] == 5
    assert len(load_tasks(env, data)) == 5
    pinned = EnvConfig(taskset={"id": "rlbus-test-echo"}, agent={"harness": {"id": "null"}, "max_turns": 3})
    data = vf_config_data(pinned)
    assert data["agent"]["harness"]["id"] == "null" and data["agent"]["max_turns"] == 3
    assert data["agent"]["runtime"]["type"] == "subprocess"


def test_a_seat_of_another_name_is_written_beside_the_taskset_as_verifiers_names_it():
    """verifiers' openenv taskset seats a ``player``: its table pastes in under that name, defaulted like ``agent``."""
    env = EnvConfig.model_validate({"taskset": {"id": "openenv", "base_url": "http://127.0.0.1:9"},
                                    "player": {"max_turns": 2}})
    assert env.seats == {"player": {"max_turns": 2}}
    data = vf_config_data(env)
    assert data["player"]["max_turns"] == 2 and data["player"]["harness"]["id"] == "rlbus-chat"
    assert EnvConfig.model_validate(env.model_dump()).seats == env.seats  # config.resolved.toml reads back
    with pytest.raises(ConfigError, match="verifiers rejects its config: .*palyer"):
        vf_config_data(EnvConfig.model_validate({"taskset": {"id": "rlbus-test-echo"}, "palyer": {"max_turns": 2}}))
    with pytest.raises(ValidationError, match="player"):
        EnvConfig.model_validate({"id": "echo_chars", "player": {"max_turns": 2}})


def test_config_mistakes_say_what_to_do(monkeypatch):
    with pytest.raises(ValidationError, match="verifiers fields"):
        EnvConfig(id="echo_chars", agent={"harness": {"id": "null"}})
    with pytest.raises(ValidationError, match="taskset needs an id"):
        EnvConfig(taskset={"num_tasks": 3})
    with pytest.raises(ConfigError, match="verifiers rejects its config"):
        vf_config_data(EnvConfig(taskset={"id": "rlbus-test-echo", "num_tasks": "many"}))
    with pytest.raises(ConfigError, match="no-such-taskset"):
        vf_config_data(EnvConfig(taskset={"id": "no-such-taskset"}))
    real = __import__("importlib.util").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "verifiers" else real(name, *a))
    with pytest.raises(ValidationError, match=r"pip install 'rlbus\[verifiers\]'"):
        EnvConfig(taskset={"id": "rlbus-test-echo"})


def test_rlbus_and_its_own_envs_do_not_import_verifiers():
    code = ("import sys, workers.stages.rollout, workers.stages.feeder, workers.run.session, workers.envs.connect, "
            "workers.inference.transformers_server; from workers.config import RlbusConfig; "
            "RlbusConfig.model_validate({'env': [{'id': 'echo_chars'}]}); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('verifiers', 'renderers', 'openenv')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


@pytest.mark.timeout(180)
async def test_spawned_server_episodes_become_token_exact_samples(server, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    vf_runner, client = runner(server, tiny_model_dir)
    handle = await VerifiersHandle.start(echo_env())
    try:
        assert handle.pid is not None and (await handle.info())["size"] == 16
        samples, timings = await vf_runner.run(task(2), handle, SAMPLING, max_turns=1)
        assert len(samples) == 4 and timings["env_s"] > 0
        messages = [{"role": "user", "content": handle.tasks[2]["prompt"]}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             return_dict=False)
        for s in samples:
            assert s.prompt_ids.tolist() == list(prompt)
            assert s.loss_mask.all() and 1 <= len(s.completion_ids) <= 6
            assert 0.0 <= s.reward <= 1.0 and "exact" in s.metrics
            # The logprobs are the server's for exactly these ids: prefill prompt + completion and compare.
            ids = s.prompt_ids.tolist() + s.completion_ids.tolist()
            prefill = await client.completions(ids, n=1, temperature=1.0, max_tokens=1, logprobs=None,
                                               prompt_logprobs=True)
            expected = prefill.prompt_logprobs[len(prompt):]
            assert s.completion_logprobs.tolist() == pytest.approx(expected, abs=2e-3)
    finally:
        await handle.close()
        await client.close()


@pytest.mark.timeout(180)
async def test_multi_turn_env_replies_are_never_trained_and_every_model_turn_is_once(server, tiny_model_dir):
    vf_runner, client = runner(server, tiny_model_dir)
    env = EnvConfig(taskset={"id": "rlbus-test-repeat", "num_tasks": 8, "turns": 2}, group_size=2)
    handle = await VerifiersHandle.start(env)
    try:
        generated_before = generated_tokens(server)
        samples, _ = await vf_runner.run(task(1, group_size=2), handle, SAMPLING, max_turns=2)
        trained = sum(int(s.loss_mask.sum()) for s in samples)
        # every token the server sampled for this group is trained once (a model turn that stopped early included)
        assert trained == generated_tokens(server) - generated_before > 0
        # 2 episodes x 2 model turns, each turn in exactly one sample (a sample per turn when the prompt re-renders)
        assert all(s.turns == 2 for s in samples) and sum(model_spans(s.loss_mask) for s in samples) == 2 * 2
        for s in samples:
            assert (s.completion_logprobs[~s.loss_mask] == 0).all() and (s.completion_logprobs[s.loss_mask] < 0).all()
            assert s.reward in (0.0, 0.5, 1.0)
    finally:
        await handle.close()
        await client.close()


@pytest.mark.timeout(180)
async def test_an_env_server_killed_mid_run_fails_the_run_at_once_and_is_restarted(server, tiny_model_dir):
    vf_runner, client = runner(server, tiny_model_dir)
    handle = await VerifiersHandle.start(echo_env())
    try:
        long = SamplingConfig(temperature=1.0, max_completion_tokens=200)
        group = asyncio.ensure_future(vf_runner.run(task(0, group_size=16), handle, long, max_turns=1))
        await asyncio.sleep(1.0)
        os.kill(handle.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RpcError, match="died"):
            await group
        assert time.monotonic() - started < 30 and handle.restarts == 1
        samples, _ = await vf_runner.run(task(1), handle, SAMPLING, max_turns=1)  # the restarted server serves
        assert len(samples) == 4
    finally:
        await handle.close()
        await client.close()


@pytest.mark.timeout(180)
async def test_an_external_server_at_an_address(server, tiny_model_dir):
    address = f"tcp://127.0.0.1:{free_port()}"
    env = echo_env(address=address)
    import json

    proc = subprocess.Popen([sys.executable, "-m", "workers.envs.verifiers_env", "--bind", address,
                             "--config", json.dumps(vf_config_data(env))], cwd=REPO)
    vf_runner, client = runner(server, tiny_model_dir)
    try:
        handle = await VerifiersHandle.start(env)
        try:
            assert handle.pid is None
            samples, _ = await vf_runner.run(task(3), handle, SAMPLING, max_turns=1)
            assert len(samples) == 4 and all(s.loss_mask.all() for s in samples)
            proc.kill()  # an external server that dies: its runs fail within the health checks, never hang
            proc.wait(20)
            started = time.monotonic()
            long = SamplingConfig(temperature=1.0, max_completion_tokens=200)
            with pytest.raises(EnvUnavailableError, match="stopped answering health"):
                await vf_runner.run(task(4), handle, long, max_turns=1)
            assert time.monotonic() - started < 30
        finally:
            await handle.close()
    finally:
        proc.terminate()
        proc.wait(20)
        await client.close()


def test_a_failed_episode_is_an_error_never_a_sample():
    class Episode:
        ok, errors, traces = False, ["HarnessError: boom"], []

    with pytest.raises(RolloutError, match="boom"):
        episode_samples(Episode(), (0, 0), 1.0)


async def test_opd_samples_carry_the_teachers_logprob_of_every_sampled_token(server, tiny_model_dir):
    client = InferenceClient([server.base_url])
    teacher = InferenceClient([server.base_url])  # the policy as its own teacher: its logprobs are the sampler's
    vf_runner = VerifiersRunner(client, served=lambda: 0, renderer_model=str(tiny_model_dir), api_key_var=None,
                                teacher=teacher)
    handle = await VerifiersHandle.start(echo_env())
    try:
        samples, timings = await vf_runner.run(task(5, mode="opd"), handle, SAMPLING, max_turns=1)
        assert len(samples) == 4 and timings["teacher_s"] > 0
        for s in samples:
            assert s.teacher_logprobs.shape == s.completion_ids.shape
            assert s.teacher_logprobs.tolist() == pytest.approx(s.completion_logprobs.tolist(), abs=2e-3)
    finally:
        await handle.close()
        await client.close()
        await teacher.close()


async def test_sft_from_references_renders_each_tasks_answer_as_rlbus_renders_its_own(tiny_model_dir):
    from transformers import AutoTokenizer

    chat = ChatTokens(AutoTokenizer.from_pretrained(tiny_model_dir))
    env = EnvConfig(taskset={"id": "rlbus-test-echo", "num_tasks": 16}, mode="sft", sft_source="reference")
    handle = await VerifiersHandle.start(env, serve=False)
    runner = VerifiersReferenceRunner(str(tiny_model_dir), served=lambda: 7, max_model_len=512)
    (sample,), timings = await runner.run(task(2, group_size=1, mode="sft"), handle, SAMPLING, max_turns=1)
    data = handle.tasks[2]
    messages = [{"role": "user", "content": data["prompt"]}]
    assert sample.prompt_ids.tolist() == chat.prompt(messages)  # what the policy is prompted with in rl
    assert sample.completion_ids.tolist() == chat.answer(messages, data["answer"])  # the answer, to <|im_end|>
    assert chat.tokenizer.decode(sample.completion_ids) == data["char"] * 4 + "<|im_end|>"
    assert sample.loss_mask.all() and sample.policy_version_start == 7 and "reference_s" in timings


def test_verifiers_envs_take_every_mode_and_say_what_each_needs():
    from workers.config import RlbusConfig
    from workers.run.checks import check_envs

    teacher = {"path": "t", "base_urls": ["http://t/v1"]}
    for mode in ("opd", "sft"):
        RlbusConfig.model_validate({"env": [{"taskset": {"id": "rlbus-test-echo"}, "mode": mode}], "teacher": teacher})
    with pytest.raises(ValidationError, match=r"a chat endpoint cannot serve them.*sft_source = \"reference\""):
        RlbusConfig.model_validate({"env": [{"taskset": {"id": "rlbus-test-echo"}, "mode": "sft"}],
                                    "teacher": {**teacher, "api": "chat", "model": "m"}})
    references = RlbusConfig.model_validate({"env": [{"taskset": {"id": "rlbus-test-repeat", "num_tasks": 3},
                                                      "mode": "sft", "sft_source": "reference"}]})
    with pytest.raises(ConfigError, match="trains on each task's 'answer' field and task 0 of taskset "
                                          "'rlbus-test-repeat' has none"):
        check_envs(references)
