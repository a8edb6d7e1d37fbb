"""The TRL side of ``peer.py``: TRL's ``GRPOTrainer`` on an rlbus config's job, and the held-out score of a model.

Single-turn envs go through TRL's own generation and a reward function; multi-turn envs through TRL's multi-turn
rollout interface (``rollout_func`` returning ``env_mask``: 1 on the model's tokens, 0 on the env's), the episodes
played by :func:`play` with rlbus's own chat tokenization (``workers.stages.episode.ChatTokens``), so both trainers
see the same tokens. Both score with the env's rubric.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path

from workers.config import RlbusConfig
from workers.envs.base import Environment
from workers.envs.server import build_env
from workers.stages.episode import ChatTokens

INDEX_KEY = "rlbus_index"
"""Where a multi-turn row's example index rides (the prompt's first message): TRL's ``rollout_func`` sees only the
prompts, and a group's samples must play the same example."""


@dataclass
class Played:
    """One episode of :func:`play`."""

    index: int
    prompt_ids: list[int]
    messages: list[dict]
    state: dict
    ids: list[int] = field(default_factory=list)
    """Everything after the prompt: the model's turns and the env's replies."""
    mask: list[int] = field(default_factory=list)
    """1 on the model's tokens, 0 on the env's."""
    done: bool = False


def generate(model, chat: ChatTokens, inputs: list[list[int]], max_new: int, temperature: float) -> list[list[int]]:
    """One batched turn: each input's new tokens up to and including the end of turn (left padding)."""
    import torch

    pad = chat.tokenizer.pad_token_id if chat.tokenizer.pad_token_id is not None else chat.end_id
    width = max(len(ids) for ids in inputs)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in inputs])
    attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in inputs])
    # the whole distribution, as rlbus's server and TRL's own generation sample (transformers' default top_k is 50)
    sample = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0
              else {"do_sample": False})
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new,
                             pad_token_id=pad, eos_token_id=chat.end_id, **sample)
    turns = []
    for row in out[:, width:].tolist():
        turns.append(row[:row.index(chat.end_id) + 1] if chat.end_id in row else row)
    return turns


def play(model, chat: ChatTokens, env: Environment, indices: list[int], max_new: int,
         temperature: float) -> list[Played]:
    """Whole episodes of ``indices``, every live one advanced a turn per batched ``generate``; as in rlbus's
    rollout, an episode ends after a turn cut at ``max_new`` tokens (no end of turn), the env having seen it."""
    episodes = []
    for index in indices:
        start = env.initial(index)
        episodes.append(Played(index, chat.prompt(start["messages"]), list(start["messages"]), start["state"]))
    while live := [ep for ep in episodes if not ep.done]:
        for ep, turn in zip(live, generate(model, chat, [ep.prompt_ids + ep.ids for ep in live], max_new,
                                           temperature), strict=True):
            ep.ids += turn
            ep.mask += [1] * len(turn)
            ep.messages.append({"role": "assistant", "content": chat.decode(turn)})
            result = env.step(ep.index, ep.messages, ep.state)
            ended = bool(turn) and turn[-1] == chat.end_id
            ep.state, ep.done = result["state"], result["done"] or not ended
            if not ep.done:
                reply = chat.continuation(ep.messages, result["messages"], ended)
                ep.ids += reply
                ep.mask += [0] * len(reply)
                ep.messages += result["messages"]
    return episodes


def held_out(config: RlbusConfig, model, tokenizer) -> float:
    """Mean reward of greedy episodes on the config's first eval env (its num_examples), as rlbus's eval scores
    them."""
    eval_cfg = config.eval.env[0]
    env = build_env(eval_cfg)
    count = len(env) if eval_cfg.num_examples < 0 else min(eval_cfg.num_examples, len(env))
    max_new = (config.eval_sampling(eval_cfg).max_completion_tokens
               or config.env[0].sampling.max_completion_tokens or 16)
    model.eval()
    chat = ChatTokens(tokenizer)
    episodes = []
    for start in range(0, count, 64):
        episodes += play(model, chat, env, list(range(start, min(count, start + 64))), max_new, 0.0)
    return sum(env.score(ep.index, ep.messages, ep.state)["reward"] for ep in episodes) / count


def multi_turn_rollout(env: Environment, chat: ChatTokens, max_new: int, temperature: float):
    """TRL's ``rollout_func`` for a multi-turn env: one episode per prompt row, its reward as ``env_reward``."""

    def rollout(prompts: list[list[dict]], trainer) -> dict:
        was_training = trainer.model.training
        trainer.model.eval()
        episodes = play(trainer.model, chat, env, [p[0][INDEX_KEY] for p in prompts], max_new, temperature)
        trainer.model.train(was_training)
        return {"prompt_ids": [ep.prompt_ids for ep in episodes],
                "completion_ids": [ep.ids for ep in episodes],
                "logprobs": [[0.0] * len(ep.ids) for ep in episodes],  # read only with vLLM's IS correction
                "env_mask": [ep.mask for ep in episodes],
                "env_reward": [env.score(ep.index, ep.messages, ep.state)["reward"] for ep in episodes]}

    return rollout


def played_reward(env_reward: list[float], **_) -> list[float]:
    """The reward :func:`multi_turn_rollout` scored each episode with."""
    return env_reward


def trl_job(config: RlbusConfig, model_dir: Path, out: Path, steps: int) -> dict:
    """TRL's GRPOTrainer on the config's job, in this process (torch threads = the cores, as rlbus's children share
    them); its steps, train rewards and held-out greedy score (``peer.py`` times the whole process)."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    env_cfg = config.env[0]
    env = build_env(env_cfg)
    sampling = env_cfg.sampling
    truncated_masked = any(f.type == "truncated" and f.enforce for f in config.filter.pre_batch_filters)
    args = GRPOConfig(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=config.batch_size(),
        num_generations=env_cfg.group_size, temperature=sampling.temperature,
        max_completion_length=sampling.max_completion_tokens * env.max_turns if env.max_turns > 1
        else sampling.max_completion_tokens,
        learning_rate=config.trainer.lr, lr_scheduler_type="constant", max_grad_norm=config.trainer.max_grad_norm,
        adam_beta1=config.trainer.betas[0], adam_beta2=config.trainer.betas[1],
        weight_decay=config.trainer.weight_decay, beta=0.0, loss_type="dapo", scale_rewards="none",
        mask_truncated_completions=truncated_masked, num_iterations=1, use_cpu=True, bf16=False,
        seed=config.run.seed, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0,
    )
    if env.max_turns > 1:
        from transformers import AutoTokenizer

        os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
        chat = ChatTokens(AutoTokenizer.from_pretrained(model_dir))
        rows = [{"prompt": [{**m, INDEX_KEY: i if n == 0 else None} for n, m in enumerate(env.initial(i)["messages"])]}
                for i in range(len(env))]
        trainer = GRPOTrainer(model=str(model_dir), args=args, train_dataset=Dataset.from_list(rows),
                              reward_funcs=played_reward,
                              rollout_func=multi_turn_rollout(env, chat, sampling.max_completion_tokens,
                                                              sampling.temperature))
    else:
        def reward(prompts, completions, index, **_):
            return [env.score(i, [*p, *c], {})["reward"] for p, c, i in zip(prompts, completions, index, strict=True)]

        rows = [{"prompt": env.prompt(env.example(i)), "index": i} for i in range(len(env))]
        trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=args,
                              train_dataset=Dataset.from_list(rows))
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    greedy = held_out(config, trainer.model, trainer.processing_class)
    return {"steps": trainer.state.global_step, "rewards": rewards, "greedy": greedy}
