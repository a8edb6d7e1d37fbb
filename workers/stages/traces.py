"""Rolling out a verifiers v1 env: ``group_size`` runs of one task → samples, token-exactly.

Each run is one ``run`` request to the env's verifiers server (:class:`workers.envs.verifiers_env.VerifiersHandle`);
the seat's model calls reach the group's one inference server through verifiers' train client
(``POST /inference/v1/generate``: token ids in, token ids and logprobs out), so the trace holds the exact ids sampled.
Every trainable branch of every trace becomes one :class:`~bus.messages.Sample`: the ids before its first sampled
token are the prompt, the rest the completion, verifiers' sampled mask the loss mask, its logprobs the logprobs (0 on
env tokens), reward = the trace's weighted reward, metrics = the trace's metrics. An episode that is not ``ok`` (a
harness, runtime or scoring error) raises :class:`RolloutError`: the rollout worker retries the task, then
dead-letters it, and nothing of it is trained.

Policy versions: a trace does not record which weights served each call, so a sample is stamped with the served
version when its group started and when it ended (``cache_salt`` = that start version, so a prefix cache never mixes
two versions' KV).

Modes: opd asks the teacher for its logprob of every token of each sample (a prefill, as for rlbus's own envs); sft
from a teacher plays the runs on the teacher's servers (:class:`VerifiersRunner` given the teacher's client); sft from
references (:class:`VerifiersReferenceRunner`) renders each task's ``answer`` as the assistant's turn with the
renderer verifiers' train client uses (``renderers`` for ``model.path``), without running the env.
"""

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from bus.messages import Sample, Task
from workers.env_config import SamplingConfig
from workers.envs.verifiers_env import ANSWER_FIELD, reference_answer, task_messages
from workers.stages.episode import RolloutError, teacher_logprobs

VERIFIERS_KNOBS = ("temperature", "top_p", "top_k", "min_p")


def vf_sampling(sampling: Any, version: int) -> dict[str, Any]:
    """rlbus's sampling as verifiers' ``SamplingConfig`` data (its extra keys reach the generate route verbatim)."""
    out = {k: getattr(sampling, k) for k in VERIFIERS_KNOBS if getattr(sampling, k, None) is not None}
    if sampling.max_completion_tokens is not None:
        out["max_tokens"] = sampling.max_completion_tokens
    if sampling.stop:
        out["stop"] = list(sampling.stop)
    return {**out, **(sampling.extra_body or {}), "cache_salt": str(version)}


def branch_sample(branch: Any, reward: float, metrics: dict[str, float], versions: tuple[int, int],
                  temperature: float, truncated: bool, turns: int) -> Sample:
    """One trainable branch as a sample: prompt = the ids before the first sampled token."""
    ids, mask, logprobs = list(branch.token_ids), list(branch.sampled_mask), list(branch.logprobs)
    if not (len(ids) == len(mask) == len(logprobs)):
        raise RolloutError(f"a verifiers branch has {len(ids)} ids, {len(mask)} mask and {len(logprobs)} logprobs")
    start = mask.index(True)
    return Sample(
        prompt_ids=np.asarray(ids[:start], dtype=np.int32),
        completion_ids=np.asarray(ids[start:], dtype=np.int32),
        completion_logprobs=np.asarray([lp if m else 0.0 for lp, m in zip(logprobs[start:], mask[start:], strict=True)],
                                       dtype=np.float32),
        loss_mask=np.asarray(mask[start:], dtype=bool),
        reward=float(reward),
        metrics=metrics,
        policy_version_start=versions[0],
        policy_version_end=versions[1],
        temperature=temperature,
        is_truncated=truncated,
        turns=turns,
    )


def episode_samples(episode: Any, versions: tuple[int, int], temperature: float) -> list[Sample]:
    """Every trainable branch of a finished episode; RolloutError when it did not finish cleanly."""
    if not episode.ok or episode.errors:
        raise RolloutError(f"verifiers episode failed: {[str(e) for e in episode.errors][:3] or 'not ok'}")
    samples = []
    for trace in episode.traces:
        if trace.has_error:
            raise RolloutError(f"verifiers trace failed: {trace.last_error}")
        metrics = {k: float(v) for k, v in (trace.metrics or {}).items() if isinstance(v, int | float)}
        turns = int(trace.num_turns)
        for branch in trace.branches:
            if any(branch.sampled_mask):
                samples.append(branch_sample(branch, trace.reward, metrics, versions, temperature,
                                             bool(trace.is_truncated), turns))
    if not samples:
        raise RolloutError("verifiers episode has no trainable branch (the model was never called)")
    return samples


class VerifiersRunner:
    """Rolls out one task of a verifiers env: ``group_size`` runs pinned to one inference server.

    ``client`` is the policy's :class:`~workers.inference.client.InferenceClient` (its servers' URLs and model
    name), or the teacher's for sft; ``served`` gives the policy version every server serves now; ``teacher``
    prefills for opd's logprobs."""

    def __init__(self, client: Any, served: Callable[[], int], renderer_model: str, api_key_var: str | None,
                 teacher: Any | None = None):
        self.client = client
        self.served = served
        self.teacher = teacher
        self.renderer_model = renderer_model
        self.api_key_var = api_key_var or "RLBUS_VERIFIERS_API_KEY"
        """The variable verifiers' train client reads the servers' API key from (unset: it sends ``EMPTY``)."""

    async def run(self, task: Task, env: Any, sampling: SamplingConfig, max_turns: int,
                  max_total_tokens: int | None = None) -> tuple[list[Sample], dict]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        server = self.client.pick_server()
        version = self.served()
        client = {"type": "train", "base_url": self.client.base_urls[server % len(self.client.base_urls)],
                  "api_key_var": self.api_key_var, "renderer_model_name": self.renderer_model}
        model = await self.client.model_name(server)
        episodes = await asyncio.gather(*(
            env.run(task.example_index, client, model, vf_sampling(sampling, version)) for _ in range(task.group_size)
        ))
        versions = (version, self.served())
        temperature = 1.0 if sampling.temperature is None else sampling.temperature
        samples = [s for ep in episodes for s in episode_samples(ep, versions, temperature)]
        timings = {"env_s": loop.time() - started}
        if task.mode == "opd":
            started = loop.time()
            await asyncio.gather(*(self._teacher_logprobs(sample) for sample in samples))
            timings["teacher_s"] = loop.time() - started
        return samples, timings

    async def _teacher_logprobs(self, sample: Sample) -> None:
        lps = await teacher_logprobs(self.teacher, sample.prompt_ids.tolist(), sample.completion_ids.tolist())
        sample.teacher_logprobs = np.where(sample.loss_mask, np.asarray(lps, dtype=np.float32), 0).astype(np.float32)


class VerifiersReferenceRunner:
    """sft from a verifiers taskset's reference answers: one sample per task, its ``answer`` as the assistant's turn
    after the conversation a chat seat opens the task with (system prompt, prompt), rendered by the renderer
    verifiers' train client builds for ``renderer_model``; the loss on the answer's tokens up to its stop token. The
    env does not run (no reward: 0)."""

    def __init__(self, renderer_model: str, served: Callable[[], int], max_model_len: int):
        self.renderer_model = renderer_model
        self.served = served
        self.max_model_len = max_model_len
        self._renderer: Any = None

    async def run(self, task: Task, env: Any, sampling: SamplingConfig, max_turns: int,
                  max_total_tokens: int | None = None) -> tuple[list[Sample], dict]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        if self._renderer is None:
            self._renderer = await asyncio.to_thread(load_renderer, self.renderer_model)
        data = env.tasks[task.example_index]
        answer = reference_answer(data)
        if answer is None:
            raise RolloutError(
                f"task {task.example_index} of env {env.name!r} has no {ANSWER_FIELD!r} field to train on")
        prompt_ids, completion_ids, mask = render_answer(self._renderer, task_messages(data), answer)
        if len(prompt_ids) + len(completion_ids) > self.max_model_len:
            raise RolloutError(f"prompt + reference answer are {len(prompt_ids) + len(completion_ids)} tokens, over "
                               f"inference.max_model_len={self.max_model_len}; raise it or shorten the tasks")
        version = self.served()
        sample = Sample(prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
                        completion_ids=np.asarray(completion_ids, dtype=np.int32),
                        completion_logprobs=np.zeros(len(completion_ids), dtype=np.float32),
                        loss_mask=np.asarray(mask, dtype=bool), policy_version_start=version,
                        policy_version_end=version)
        return [sample], {"reference_s": loop.time() - started}


def load_renderer(model: str) -> Any:
    """The renderer verifiers' train client builds for ``model`` (``renderer_model_name``, no renderer config)."""
    from renderers import create_renderer
    from renderers.base import load_tokenizer

    return create_renderer(load_tokenizer(model), None)


def render_answer(renderer: Any, messages: list[dict], answer: str) -> tuple[list[int], list[int], list[bool]]:
    """(prompt ids with the generation prompt, the answer turn's ids up to its stop token, its loss mask: the
    renderer's sampled mask where it gives one, else every answer token)."""
    prompt = renderer.render_ids(messages, add_generation_prompt=True)
    full = renderer.render(messages + [{"role": "assistant", "content": answer}], add_generation_prompt=False)
    ids = list(full.token_ids)
    if ids[:len(prompt)] != list(prompt):
        raise RolloutError("the renderer does not render an assistant turn after the generation prompt; sft from "
                           "reference answers needs an append-only chat template")
    stops = set(renderer.get_stop_token_ids())
    end = next((i + 1 for i, t in enumerate(ids[len(prompt):]) if t in stops), len(ids) - len(prompt))
    completion = ids[len(prompt):len(prompt) + end]
    sampled = list(full.sampled_mask)[len(prompt):len(prompt) + end]
    return list(prompt), completion, sampled if sampled else [True] * len(completion)
