"""Trainer and the built-in inference server together: on-policy logprobs agree, new weights get served."""


import numpy as np
import torch

from bus.local_redis import free_port
from bus.messages import Metric, MicroBatch
from bus.policy import PolicyTracker
from tests.workers.inference.process import InferenceProcess
from trainer.worker import TrainerWorker
from workers.config import RlbusConfig
from workers.inference.client import InferenceClient
from workers.lifecycle import run_worker

torch.set_num_threads(1)
SERVER = "s1"


def batch_from(prompt: list[int], result, temperature: float) -> MicroBatch:
    """Step 1's single micro-batch from the server's samples (version 0), advantages ±1."""
    ids, pos, mask, inf, adv, lengths = [], [], [], [], [], []
    for i, choice in enumerate(result.choices):
        n_c = len(choice.token_ids)
        ids += prompt + choice.token_ids
        pos += list(range(len(prompt) + n_c))
        mask += [False] * len(prompt) + [True] * n_c
        inf += [0.0] * len(prompt) + list(choice.logprobs)
        adv += [0.0] * len(prompt) + [1.0 if i % 2 else -1.0] * n_c
        lengths.append(len(prompt) + n_c)
    return MicroBatch(step=1, index=0, count=1, mode="rl", input_ids=np.array(ids, np.int32),
                      position_ids=np.array(pos, np.int32), loss_mask=np.array(mask),
                      advantages=np.array(adv, np.float32), inference_logprobs=np.array(inf, np.float32),
                      temperatures=np.full(len(ids), temperature, np.float32),
                      sample_lengths=np.array(lengths, np.int32), policy_versions=np.zeros(len(lengths), np.int32),
                      rewards=np.zeros(len(lengths), np.float32))


async def test_on_policy_kl_and_new_weights_reach_the_server(tiny_model_dir, redis_url, bus, run_name, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg_path = tmp_path / "cfg.toml"
    cfg_path.write_text(
        f'[run]\nname = "{run_name}"\noutput_dir = "{tmp_path / "out"}"\nmax_steps = 1\n'
        f'[redis]\nurl = "{redis_url}"\nblock_ms = 100\n[model]\npath = "{tiny_model_dir}"\n'
        f'[inference]\nnum_threads = 1\nmax_model_len = 512\n[trainer]\ndevice = "cpu"\nlr = 0.05\n'
    )
    from workers.config_loader import load_config

    config: RlbusConfig = load_config([cfg_path])
    prompt = [104, 101, 108, 108, 111]
    greedy_prompt = [114, 101, 118]
    with InferenceProcess(cfg_path, free_port(), SERVER, log_path=tmp_path / "server.log") as server:
        async with InferenceClient([server.base_url]) as client:
            greedy_before = await client.completions(greedy_prompt, n=1, temperature=0.0, max_tokens=12,
                                                     extra_body={"ignore_eos": True})
            result = await client.completions(prompt, n=4, temperature=0.8, max_tokens=16, seed=0)
        assert result.policy_version == 0
        async with bus("packer") as b:
            await b.publish(b.keys.batches(1), batch_from(prompt, result, 0.8))
        await run_worker(TrainerWorker(config))
        async with bus("reader") as b:
            metrics = [m for _, m in await b.read_fanout(b.keys.metrics(), "0") if isinstance(m, Metric)]
            await PolicyTracker(b).wait(lambda t: t.served_by.get(SERVER) == 1, timeout_s=60)
        async with InferenceClient([server.base_url]) as client:
            greedy = await client.completions(greedy_prompt, n=1, temperature=0.0, max_tokens=12,
                                              extra_body={"ignore_eos": True})
    values = metrics[0].values
    assert values["mismatch_kl"] < 1e-4, values
    assert values["grad_norm"] > 0
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "weights" / "step_1").eval()
    expected = list(greedy_prompt)
    with torch.no_grad():
        for _ in range(12):
            expected.append(int(trained(torch.tensor([expected])).logits[0, -1].argmax()))
    assert greedy.policy_version == 1
    assert greedy.choices[0].token_ids == expected[len(greedy_prompt):]
    assert greedy_before.choices[0].token_ids != greedy.choices[0].token_ids  # the update changed the policy
