"""LoRA (``[model.lora]``): the trainer trains, checkpoints and publishes only the adapter; the built-in server
applies each version's adapter and serves what the trainer computes."""


import torch

from bus.local_redis import free_port
from bus.messages import Metric, WeightUpdate
from bus.policy import PolicyTracker
from tests.trainer.test_weights_to_inference import batch_from
from tests.workers.inference.process import InferenceProcess
from trainer.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_adapter_key, merged_model
from trainer.worker import TrainerWorker
from workers.config_loader import load_config
from workers.inference.client import InferenceClient
from workers.lifecycle import run_worker

torch.set_num_threads(1)
SERVER = "lora-s1"


async def test_lora_trains_publishes_and_serves_only_the_adapter(tiny_model_dir, redis_url, bus, run_name,
                                                                 tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    cfg_path = tmp_path / "cfg.toml"
    cfg_path.write_text(
        f'[run]\nname = "{run_name}"\noutput_dir = "{out}"\nmax_steps = 1\n'
        f'[redis]\nurl = "{redis_url}"\nblock_ms = 100\n[model]\npath = "{tiny_model_dir}"\n'
        f'[model.lora]\nrank = 8\nalpha = 16\n[ckpt]\ninterval = 1\n'
        f'[inference]\nnum_threads = 1\nmax_model_len = 512\n[trainer]\ndevice = "cpu"\nlr = 0.05\n'
    )
    config = load_config([cfg_path])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    prompt, greedy_prompt = [104, 101, 108, 108, 111], [114, 101, 118]
    with InferenceProcess(cfg_path, free_port(), SERVER, log_path=tmp_path / "server.log") as server:
        async with InferenceClient([server.base_url]) as client:
            result = await client.completions(prompt, n=4, temperature=0.8, max_tokens=16, seed=0)
        async with bus("packer") as b:
            await b.publish(b.keys.batches(1), batch_from(prompt, result, 0.8))
        trainer = TrainerWorker(config)
        await run_worker(trainer)
        async with bus("reader") as b:
            metrics = [m for _, m in await b.read_fanout(b.keys.metrics(), "0") if isinstance(m, Metric)]
            events = [e for _, e in await b.read_fanout(b.keys.weights(), "0") if isinstance(e, WeightUpdate)]
            await PolicyTracker(b).wait(lambda t: t.served_by.get(SERVER) == 1, timeout_s=60)
        async with InferenceClient([server.base_url]) as client:
            greedy = await client.completions(greedy_prompt, n=1, temperature=0.0, max_tokens=12,
                                              extra_body={"ignore_eos": True})

    assert metrics[0].values["mismatch_kl"] < 1e-4  # the adapter starts at zero: version 0 is the base model
    # Only the adapter trained: every base tensor is as loaded, and the adapter moved.
    trained = dict(trainer.policy.lm.named_parameters())
    base_state = base.state_dict()
    for name, param in trained.items():
        if is_adapter_key(name):
            continue
        assert not param.requires_grad, name
        assert torch.equal(param.detach(), base_state[name.replace(".base_layer.", ".")]), name
    assert any(trained[n].abs().sum() > 0 for n in trained if ".lora_B." in n)

    # The event carries the adapter (a few files, a fraction of the model), named for its version.
    (event,) = [e for e in events if e.step == 1]
    assert event.adapter == "r8-a16-step1" and {f.name for f in event.files} == {ADAPTER_WEIGHTS, ADAPTER_CONFIG}
    full_bytes = sum(t.numel() * t.element_size() for t in base_state.values())
    assert sum(f.bytes for f in event.files) < 0.15 * full_bytes
    ckpt = torch.load(out / "checkpoints" / "step_1" / "trainer.pt", weights_only=True)
    assert ckpt["model"] and all(is_adapter_key(k) for k in ckpt["model"])  # adapter + optimizer, no base copy
    assert ckpt["optimizer"]["state"]

    # The server applies it: its greedy tokens and logprobs are the merged model's.
    merged = merged_model(tiny_model_dir, out / "weights" / "step_1").eval()
    ids = list(greedy_prompt)
    expected_logprobs = []
    with torch.no_grad():
        for _ in range(12):
            logprobs = torch.log_softmax(merged(torch.tensor([ids])).logits[0, -1].float(), -1)
            ids.append(int(logprobs.argmax()))
            expected_logprobs.append(float(logprobs.max()))
    assert greedy.policy_version == 1
    assert greedy.choices[0].token_ids == ids[len(greedy_prompt):]
    assert max(abs(a - b) for a, b in zip(greedy.choices[0].logprobs, expected_logprobs, strict=True)) < 1e-4


def test_a_lora_checkpoint_resumes_the_adapter_and_optimizer(tiny_model_dir, tmp_path):
    from trainer.checkpoint import Checkpointer
    from trainer.config import CkptConfig
    from trainer.dist import DistContext
    from trainer.logprobs import PolicyModel
    from trainer.lora import inject, peft_config
    from trainer.model import load_model

    def policy():
        lm = load_model(tiny_model_dir, torch.device("cpu"), torch.float32)
        return PolicyModel(inject(lm, peft_config(4, 8, 0.0, ["q_proj", "v_proj"], str(tiny_model_dir))))

    ctx = DistContext(rank=0, world_size=1, local_rank=0)
    first = policy()
    optimizer = torch.optim.AdamW([p for p in first.parameters() if p.requires_grad], lr=0.1)
    for p in first.parameters():
        if p.requires_grad:
            p.grad = torch.ones_like(p)
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    ckpt = Checkpointer(tmp_path, CkptConfig(interval=1), ctx, trainable_only=True)
    ckpt.save(3, first, optimizer, scheduler)

    second = policy()
    optimizer2 = torch.optim.AdamW([p for p in second.parameters() if p.requires_grad], lr=0.1)
    scheduler2 = torch.optim.lr_scheduler.LambdaLR(optimizer2, lambda _: 1.0)
    ckpt.load(3, second, optimizer2, scheduler2)
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert optimizer2.state_dict()["state"][0]["step"] == 1
