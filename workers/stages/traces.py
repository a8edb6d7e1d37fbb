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
"""

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from bus.messages import Sample, Task
from workers.env_config import SamplingConfig
from workers.stages.episode import RolloutError

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
    name); ``served`` gives the policy version every server serves now."""

    def __init__(self, client: Any, served: Callable[[], int], renderer_model: str, api_key_var: str | None):
        self.client = client
        self.served = served
        self.renderer_model = renderer_model
        self.api_key_var = api_key_var or "RLBUS_VERIFIERS_API_KEY"
        """The variable verifiers' train client reads the servers' API key from (unset: it sends ``EMPTY``)."""

    async def run(self, task: Task, env: Any, sampling: SamplingConfig, max_turns: int,
                  max_total_tokens: int | None = None) -> tuple[list[Sample], dict]:
        if task.mode != "rl":
            raise RolloutError(f"mode {task.mode!r} is not supported on verifiers envs yet; use mode = \"rl\"")
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
        return samples, {"env_s": loop.time() - started}
