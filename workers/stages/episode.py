"""One task's group of episodes: prompt → model turns (+ env turns) → scored samples.

Token layout of a sample (what the trainer sees)::

    prompt_ids      = chat_template(initial messages, add_generation_prompt=True)
    completion_ids  = model turn 1 (…<|im_end|>) | env reply 1 | model turn 2 | env reply 2 | …
    loss_mask       = True on model tokens, False on env tokens
    logprobs        = the inference logprob of each model token, 0 on env tokens

An env reply's tokens are the chat template's continuation after the model's end-of-turn token:
``"\\n<|im_start|>user\\n…<|im_end|>\\n<|im_start|>assistant\\n"`` for ChatML. The next model turn's
prompt is the whole sequence so far, so the model conditions on exactly the tokens trained on.
"""

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bus.errors import RlbusError
from bus.messages import Sample, Task
from workers.env_config import EvalSamplingConfig, SamplingConfig

Sampling = SamplingConfig | EvalSamplingConfig


@dataclass(frozen=True)
class Limit:
    """What bounds the model turns of one group's episodes: its sampling (per-turn cap) and its total budget."""

    sampling: Sampling
    total_tokens: int | None = None
    """Model tokens over all turns of one episode (None: no such budget)."""

END_OF_TURN = "<|im_end|>"
"""ChatML's end-of-turn token; tokenizers without it use their eos token."""


class RolloutError(RlbusError):
    """A rollout cannot be built (template mismatch, prompt longer than the model's context)."""


class ChatTokens:
    """Chat-template tokenization for one tokenizer: prompts, and env replies as continuations."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self.end_text = END_OF_TURN if END_OF_TURN in vocab else tokenizer.eos_token
        if self.end_text is None:
            raise RolloutError("the tokenizer has neither <|im_end|> nor an eos token; cannot tell where a turn ends")
        self.end_id = tokenizer.convert_tokens_to_ids(self.end_text)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` with the generation prompt (the first model turn's prompt)."""
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if hasattr(ids, "keys"):  # transformers ≥ 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def answer(self, messages: list[dict], text: str) -> list[int]:
        """Token ids of an assistant turn saying ``text`` after ``messages`` (the generation prompt excluded, the
        end-of-turn token included): what the model would have generated to say it."""
        head = self._render(messages, add_generation_prompt=True)
        full = self._render(messages + [{"role": "assistant", "content": text}], add_generation_prompt=False)
        end = full.find(self.end_text, len(head))
        if not full.startswith(head) or end < 0:
            raise RolloutError("the chat template does not render an assistant turn after the generation prompt; "
                               "sft from reference answers needs an append-only template")
        return self.tokenizer.encode(full[len(head):end + len(self.end_text)], add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """The text of a model turn, special tokens dropped (what goes into the assistant message)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def continuation(self, messages: list[dict], env_messages: list[dict], ended: bool) -> list[int]:
        """Tokens after the model's last turn up to the next generation prompt.

        ``messages`` ends with the model's assistant message; ``ended`` says whether the model's
        tokens already end with the end-of-turn token (else it is part of the continuation).
        """
        before = self._render(messages, add_generation_prompt=False)
        after = self._render(messages + env_messages, add_generation_prompt=True)
        cut = before.rfind(self.end_text)
        if not after.startswith(before) or cut < 0:
            raise RolloutError(
                "the chat template does not render a conversation as a prefix of its continuation (or has no "
                f"{self.end_text!r} after the assistant turn); multi-turn envs need an append-only template"
            )
        start = cut + len(self.end_text) if ended else cut
        return self.tokenizer.encode(before[start:] + after[len(before):], add_special_tokens=False)


@dataclass
class Episode:
    """One sample being built: tokens, masks, conversation, env state."""

    prompt_ids: list[int]
    messages: list[dict]
    state: dict
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    turns: int = 0
    truncated: bool = False
    version_start: int | None = None
    version_end: int | None = None
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    teacher_logprobs: list[float] | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def add_model_turn(self, ids: list[int], logprobs: list[float], versions: tuple[int, int]) -> None:
        if len(ids) != len(logprobs):
            raise RolloutError(f"inference returned {len(ids)} tokens but {len(logprobs)} logprobs")
        self.completion_ids += ids
        self.logprobs += [float(x) for x in logprobs]
        self.mask += [True] * len(ids)
        self.turns += 1
        self.version_start = versions[0] if self.version_start is None else self.version_start
        self.version_end = versions[1]

    def add_env_turn(self, ids: list[int]) -> None:
        self.completion_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [False] * len(ids)

    def to_sample(self, temperature: float) -> Sample:
        teacher = None
        if self.teacher_logprobs is not None:
            teacher = np.where(self.mask, np.asarray(self.teacher_logprobs, dtype=np.float32), 0).astype(np.float32)
        return Sample(
            prompt_ids=np.asarray(self.prompt_ids, dtype=np.int32),
            completion_ids=np.asarray(self.completion_ids, dtype=np.int32),
            completion_logprobs=np.asarray(self.logprobs, dtype=np.float32),
            loss_mask=np.asarray(self.mask, dtype=bool),
            teacher_logprobs=teacher,
            reward=float(self.reward),
            metrics={k: float(v) for k, v in self.metrics.items()},
            policy_version_start=self.version_start or 0,
            policy_version_end=self.version_end or 0,
            temperature=temperature,
            is_truncated=self.truncated,
            turns=self.turns,
        )


@dataclass
class Timer:
    """Seconds per phase, summed over the group's samples."""

    totals: dict[str, float] = field(default_factory=dict)

    async def time(self, phase: str, awaitable):
        started = time.monotonic()
        try:
            return await awaitable
        finally:
            self.totals[phase] = self.totals.get(phase, 0.0) + time.monotonic() - started


async def all_or_none(*awaitables) -> list:
    """Run ``awaitables`` concurrently; the first to fail cancels the others, waits for them, and is raised (so
    nothing of a failed group runs on behind its back)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def score_episode(ep: Episode, task: Task, env: Any, timer: Timer) -> None:
    """The env's reward and metrics of a finished episode, into the episode."""
    scored = await timer.time("score_s", env.score(index=task.example_index, messages=ep.messages, state=ep.state))
    ep.reward = float(scored["reward"])
    ep.metrics = dict(scored.get("metrics") or {})


class GroupRunner:
    """Rolls out one task: ``group_size`` episodes against one env server and one inference server.

    ``client`` samples (the student, or the teacher in sft mode); ``teacher`` prefills for opd
    logprobs; ``fallback_version`` gives the served policy when a server reports none (vLLM).
    """

    def __init__(self, chat: ChatTokens, client: Any, teacher: Any | None, max_model_len: int,
                 fallback_version: Callable[[], int]):
        self.chat = chat
        self.client = client
        self.teacher = teacher
        self.max_model_len = max_model_len
        self.fallback_version = fallback_version

    async def run(self, task: Task, env: Any, sampling: Sampling, max_turns: int,
                  max_total_tokens: int | None = None) -> tuple[list[Sample], dict]:
        """The group's samples and its timings (``generate_s``, ``env_s``, ``score_s``, ``teacher_s``); an episode
        ends truncated once its model turns spent ``max_total_tokens`` (None: no budget over turns)."""
        limit = Limit(sampling, max_total_tokens)
        timer = Timer()
        initial = await timer.time("env_s", env.initial(index=task.example_index))
        prompt_ids = self.chat.prompt(initial["messages"])
        server = self.client.pick_server()
        first = await timer.time("generate_s", self._sample(prompt_ids, task.group_size, limit, server))
        episodes = []
        for choice in first.choices:
            ep = Episode(list(prompt_ids), list(initial["messages"]), dict(initial.get("state") or {}))
            self._add_turn(ep, choice, self._versions(first, task))
            episodes.append(ep)
        try:
            await all_or_none(*(self._play(ep, task, env, limit, max_turns, server, timer) for ep in episodes))
            await all_or_none(*(score_episode(ep, task, env, timer) for ep in episodes))
        except BaseException:  # failed, or cancelled by the rollout's timeout: free what the env holds for them
            await asyncio.gather(*(env.release(ep.state) for ep in episodes), return_exceptions=True)
            raise
        if task.mode == "opd":
            await asyncio.gather(*(self._teacher_logprobs(ep, timer) for ep in episodes))
        temperature = 1.0 if sampling.temperature is None else sampling.temperature  # None: the server's default
        return [ep.to_sample(temperature) for ep in episodes], timer.totals

    def _budget(self, length: int, limit: Limit, spent: int = 0) -> int:
        """Tokens the next model turn may take: the context left, the per-turn cap, the episode's budget left."""
        left = self.max_model_len - length
        if limit.total_tokens is not None:
            left = min(left, limit.total_tokens - spent)
        per_turn = limit.sampling.max_completion_tokens
        return left if per_turn is None else min(left, per_turn)

    async def _sample(self, ids: list[int], n: int, limit: Limit, server: int, spent: int = 0):
        sampling = limit.sampling
        budget = self._budget(len(ids), limit, spent)
        if budget < 1:
            raise RolloutError(
                f"prompt of {len(ids)} tokens leaves no room under inference.max_model_len={self.max_model_len}; "
                "raise max_model_len or shorten the env's prompts"
            )
        return await self.client.completions(
            ids, n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            min_p=sampling.min_p, max_tokens=budget, stop=sampling.stop or None, seed=None, logprobs=True,
            server_index=server, reasoning_effort=getattr(sampling, "reasoning_effort", None),
            extra_body=sampling.extra_body or None,
        )

    def _versions(self, result: Any, task: Task) -> tuple[int, int]:
        """Student policy versions at the start and end of a response: the server's, else the tracker's
        (always in sft mode, where the sampling server is the teacher's)."""
        start = getattr(result, "policy_version", None)
        if task.mode == "sft" or start is None:
            version = self.fallback_version()
            return version, version
        end = getattr(result, "policy_version_end", None)
        return int(start), int(end if end is not None else start)

    def _add_turn(self, ep: Episode, choice: Any, versions: tuple[int, int]) -> None:
        ids = [int(i) for i in choice.token_ids]
        ep.add_model_turn(ids, list(choice.logprobs), versions)
        ep.truncated = choice.finish_reason == "length"
        ep.messages.append({"role": "assistant", "content": self.chat.decode(ids)})

    async def _play(self, ep: Episode, task: Task, env: Any, limit: Limit, max_turns: int,
                    server: int, timer: Timer) -> None:
        """Env step after every model turn; the next model turn until done, truncated or max_turns."""
        while True:
            reply = await timer.time("env_s", env.step(index=task.example_index, messages=ep.messages, state=ep.state))
            ep.state = dict(reply.get("state") or {})
            if reply["done"] or ep.truncated or ep.turns >= max_turns:
                return
            ended = bool(ep.completion_ids) and ep.completion_ids[-1] == self.chat.end_id
            env_ids = self.chat.continuation(ep.messages, reply["messages"], ended)
            spent = sum(ep.mask)
            if self._budget(len(ep.tokens) + len(env_ids), limit, spent) < 1:
                ep.truncated = True  # no room (context or token budget) for another model turn: end here
                return
            ep.add_env_turn(env_ids)
            ep.messages += reply["messages"]
            result = await timer.time("generate_s", self._sample(ep.tokens, 1, limit, server, spent))
            self._add_turn(ep, result.choices[0], self._versions(result, task))

    async def _teacher_logprobs(self, ep: Episode, timer: Timer) -> None:
        ep.teacher_logprobs = await timer.time("teacher_s", teacher_logprobs(self.teacher, ep.prompt_ids,
                                                                             ep.completion_ids))


async def teacher_logprobs(teacher: Any, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """opd: the teacher's logprob of every completion token, by prefilling prompt + completion."""
    result = await teacher.completions(
        list(prompt_ids) + list(completion_ids), n=1, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, max_tokens=1,
        stop=None, seed=None, logprobs=False, prompt_logprobs=True,
    )
    lps = result.prompt_logprobs[len(prompt_ids):]
    if len(lps) != len(completion_ids):
        raise RolloutError(f"teacher returned {len(lps)} prompt logprobs for {len(completion_ids)} completion tokens")
    return [0.0 if x is None else float(x) for x in lps]


class AnswerRunner:
    """sft on answers given as text: each of the task's answers (the example's reference, or a chat teacher's
    replies) with the example's prompt becomes a sample, the loss on the answer's tokens (the student's chat
    template); no policy server is asked. Scored by the env like any episode (its metrics say how the answers fare
    on the env's own rubric).

    ``answers(task, env, messages, sampling)`` returns the answer texts of a task, at most ``task.group_size``."""

    def __init__(self, chat: ChatTokens, max_model_len: int, fallback_version: Callable[[], int],
                 answers: Callable[[Task, Any, list[dict], Sampling], Any], source: str):
        self.chat = chat
        self.max_model_len = max_model_len
        self.fallback_version = fallback_version
        self.answers = answers
        self.source = source
        """What the answers are, for errors and the timing name (``reference``, ``teacher``)."""

    async def run(self, task: Task, env: Any, sampling: Sampling, max_turns: int,
                  max_total_tokens: int | None = None) -> tuple[list[Sample], dict]:
        timer = Timer()
        initial = await timer.time("env_s", env.initial(index=task.example_index))
        messages = list(initial["messages"])
        texts = await timer.time(f"{self.source}_s", self.answers(task, env, messages, sampling))
        prompt_ids = self.chat.prompt(messages)
        samples = []
        for text in texts:
            ep = Episode(list(prompt_ids), messages + [{"role": "assistant", "content": text}],
                         dict(initial.get("state") or {}))
            ids = self.chat.answer(messages, text)
            if len(ep.prompt_ids) + len(ids) > self.max_model_len:
                raise RolloutError(f"prompt + {self.source} answer are {len(ep.prompt_ids) + len(ids)} tokens, over "
                                   f"inference.max_model_len={self.max_model_len}; raise it or shorten the examples")
            version = self.fallback_version()
            ep.add_model_turn(ids, [0.0] * len(ids), (version, version))
            stepped = await timer.time("env_s", env.step(index=task.example_index, messages=ep.messages,
                                                         state=ep.state))
            ep.state = dict(stepped.get("state") or {})
            await score_episode(ep, task, env, timer)
            samples.append(ep.to_sample(1.0))
        return samples, timer.totals


async def reference_answers(task: Task, env: Any, messages: list[dict], sampling: Sampling) -> list[str]:
    """The example's reference answer (sft from data)."""
    return [await env.reference(index=task.example_index)]


def chat_answers(client: Any) -> Callable[[Task, Any, list[dict], Sampling], Any]:
    """A chat teacher's answers: ``task.group_size`` replies from ``/v1/chat/completions`` (no logprobs asked;
    only the knobs OpenAI's API knows are sent, and only those set: the student's ``extra_body`` is for its own
    servers). An empty or cut-off answer fails the task (retried, then dead-lettered) rather than teach it."""

    async def answers(task: Task, env: Any, messages: list[dict], sampling: Sampling) -> list[str]:
        knobs = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                 "max_completion_tokens": sampling.max_completion_tokens, "stop": sampling.stop or None}
        reply = await client.chat(messages, n=task.group_size, **{k: v for k, v in knobs.items() if v is not None})
        choices = reply.get("choices") or []
        if len(choices) != task.group_size:
            raise RolloutError(f"the chat teacher gave {len(choices)} answers for n={task.group_size}")
        texts = []
        for choice in choices:
            text, reason = (choice.get("message") or {}).get("content"), choice.get("finish_reason")
            if not text or reason not in (None, "stop"):  # a refusal, a filter, an answer cut off: nothing to learn
                raise RolloutError(f"the chat teacher's answer is not a whole one (finish_reason={reason!r}, "
                                   f"{len(text or '')} characters); raise max_completion_tokens or check the teacher")
            texts.append(text)
        return texts

    return answers

