"""Episode building with the tiny byte-level tokenizer and scripted env/inference fakes (no servers)."""

from dataclasses import dataclass

import numpy as np
import pytest

from bus.messages import Task
from workers.env_config import SamplingConfig
from workers.stages.episode import (
    AnswerRunner,
    ChatTokens,
    GroupRunner,
    RolloutError,
    chat_answers,
    reference_answers,
)
from workers.tools.init_model import build_tokenizer


@pytest.fixture(scope="module")
def chat():
    return ChatTokens(build_tokenizer())


@dataclass
class Choice:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"


@dataclass
class Result:
    choices: list[Choice]
    policy_version: int | None = 3
    prompt_logprobs: list | None = None


class ScriptedClient:
    """Answers every request with the text 'ok' + <|im_end|>; records prompts."""

    def __init__(self, chat, version=3):
        self.chat, self.version, self.prompts, self.max_tokens = chat, version, [], []

    def pick_server(self):
        return 0

    async def completions(self, ids, *, n, max_tokens, prompt_logprobs=False, extra_body=None, **_):
        self.prompts.append(list(ids))
        self.max_tokens.append(max_tokens)
        if prompt_logprobs:
            return Result([Choice([1], [0.0])], 0, [None] + [-0.5] * (len(ids) - 1))
        body = self.chat.tokenizer.encode("ok", add_special_tokens=False) + [self.chat.end_id]
        return Result([Choice(body, [-0.1 * (i + 1) for i in range(len(body))]) for _ in range(n)], self.version)


class TwoTurnEnv:
    """Replies once ('again'), then is done; reward = number of model turns."""

    async def initial(self, index):
        return {"messages": [{"role": "user", "content": f"q{index}"}], "state": {"turn": 0}}

    async def step(self, index, messages, state):
        turn = state["turn"] + 1
        done = turn >= 2
        messages = [] if done else [{"role": "user", "content": "again"}]
        return {"messages": messages, "done": done, "state": {"turn": turn}}

    async def score(self, index, messages, state):
        return {"reward": float(sum(m["role"] == "assistant" for m in messages)), "metrics": {"turns": state["turn"]}}


def test_prompt_and_continuation_follow_the_chat_template(chat):
    tok = chat.tokenizer
    messages = [{"role": "user", "content": "hi"}]
    assert tok.decode(chat.prompt(messages)) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    convo = messages + [{"role": "assistant", "content": "yo"}]
    cont = chat.continuation(convo, [{"role": "user", "content": "more"}], ended=True)
    assert tok.decode(cont) == "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    cont = chat.continuation(convo, [{"role": "user", "content": "more"}], ended=False)
    assert tok.decode(cont).startswith("<|im_end|>\n<|im_start|>user")


async def test_multi_turn_masks_and_logprobs(chat):
    client = ScriptedClient(chat)
    runner = GroupRunner(chat, client, None, max_model_len=512, fallback_version=lambda: 0)
    task = Task(task_id="e:0:0", env="e", example_index=5, example_id="5", group_size=3)
    samples, timings = await runner.run(task, TwoTurnEnv(), SamplingConfig(), max_turns=4)
    assert len(samples) == 3 and set(timings) >= {"generate_s", "env_s", "score_s"}
    s = samples[0]
    tok = chat.tokenizer
    text = tok.decode(np.concatenate([s.prompt_ids, s.completion_ids]))
    assert text == ("<|im_start|>user\nq5<|im_end|>\n<|im_start|>assistant\nok<|im_end|>"
                    "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\nok<|im_end|>")
    model = tok.encode("ok", add_special_tokens=False) + [chat.end_id]
    env_tokens = chat.continuation([{"role": "assistant", "content": "ok"}], [{"role": "user", "content": "again"}],
                                   ended=True)
    assert s.loss_mask.tolist() == [True] * 3 + [False] * len(env_tokens) + [True] * 3
    assert s.completion_ids[s.loss_mask].tolist() == model + model  # model tokens, <|im_end|> included
    lp = [-0.1, -0.2, -0.3]
    np.testing.assert_allclose(s.completion_logprobs, lp + [0.0] * len(env_tokens) + lp, rtol=1e-6)
    assert len(s.completion_logprobs) == len(s.completion_ids) == len(s.loss_mask)
    assert s.turns == 2 and s.reward == 2.0 and s.metrics == {"turns": 2.0}
    assert (s.policy_version_start, s.policy_version_end) == (3, 3)
    # The second model turn is prompted with exactly the tokens so far.
    assert client.prompts[-1] == s.prompt_ids.tolist() + s.completion_ids[: 3 + len(env_tokens)].tolist()


async def test_opd_teacher_logprobs_are_aligned_and_masked(chat):
    client = ScriptedClient(chat)
    runner = GroupRunner(chat, client, ScriptedClient(chat), max_model_len=512, fallback_version=lambda: 0)
    task = Task(task_id="e:0:0", env="e", example_index=1, example_id="1", group_size=1, mode="opd")
    (s,), _ = await runner.run(task, TwoTurnEnv(), SamplingConfig(), max_turns=4)
    assert s.teacher_logprobs is not None and len(s.teacher_logprobs) == len(s.completion_ids)
    assert np.all(s.teacher_logprobs[s.loss_mask] == np.float32(-0.5))
    assert np.all(s.teacher_logprobs[~s.loss_mask] == 0)


async def test_sft_and_missing_server_versions_use_the_tracker(chat):
    runner = GroupRunner(chat, ScriptedClient(chat, version=None), None, max_model_len=512, fallback_version=lambda: 7)
    task = Task(task_id="e:0:0", env="e", example_index=1, example_id="1", group_size=1)
    (s,), _ = await runner.run(task, TwoTurnEnv(), SamplingConfig(), max_turns=1)
    assert (s.policy_version_start, s.policy_version_end, s.turns) == (7, 7, 1)
    runner = GroupRunner(chat, ScriptedClient(chat, version=2), None, max_model_len=512, fallback_version=lambda: 9)
    (s,), _ = await runner.run(task.replace(mode="sft"), TwoTurnEnv(), SamplingConfig(), 1)
    assert s.policy_version_start == 9


async def test_prompt_longer_than_the_context_is_an_error(chat):
    runner = GroupRunner(chat, ScriptedClient(chat), None, max_model_len=8, fallback_version=lambda: 0)
    task = Task(task_id="e:0:0", env="e", example_index=1, example_id="1", group_size=1)
    with pytest.raises(RolloutError, match="max_model_len=8"):
        await runner.run(task, TwoTurnEnv(), SamplingConfig(), max_turns=1)


async def test_context_limit_truncates_a_multi_turn_episode(chat):
    runner = GroupRunner(chat, ScriptedClient(chat), None, max_model_len=40, fallback_version=lambda: 0)
    task = Task(task_id="e:0:0", env="e", example_index=1, example_id="1", group_size=1)
    (s,), _ = await runner.run(task, TwoTurnEnv(), SamplingConfig(), max_turns=4)
    assert s.is_truncated and s.turns == 1 and s.loss_mask.all()  # no dangling env reply


async def test_a_total_token_budget_spans_the_turns_of_an_episode(chat):
    client = ScriptedClient(chat)  # every model turn is 3 tokens
    runner = GroupRunner(chat, client, None, max_model_len=512, fallback_version=lambda: 0)
    task = Task(task_id="e:0:0", env="e", example_index=1, example_id="1", group_size=1)
    (s,), _ = await runner.run(task, TwoTurnEnv(), SamplingConfig(max_completion_tokens=10), 4,
                               max_total_tokens=5)
    assert client.max_tokens == [5, 2] and s.turns == 2  # the second turn may spend what the first left
    (s,), _ = await runner.run(task, TwoTurnEnv(), SamplingConfig(), 4, max_total_tokens=3)
    assert s.is_truncated and s.turns == 1 and s.loss_mask.all()  # the budget is spent: no env reply, no turn


class ReferenceEnv(TwoTurnEnv):
    """Knows the answer of every example; scores 1.0 for it."""

    async def reference(self, index):
        return f"answer {index}"

    async def score(self, index, messages, state):
        return {"reward": float(messages[-1]["content"] == f"answer {index}"), "metrics": {}}


async def test_sft_from_data_trains_on_the_reference_answer_with_the_chat_template(chat):
    runner = AnswerRunner(chat, 512, lambda: 4, reference_answers, "reference")
    task = Task(task_id="e:0:0", env="e", example_index=7, example_id="7", group_size=1, mode="sft")
    (s,), timings = await runner.run(task, ReferenceEnv(), SamplingConfig(), max_turns=1)
    tok = chat.tokenizer
    assert tok.decode(s.prompt_ids) == "<|im_start|>user\nq7<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(s.completion_ids) == "answer 7<|im_end|>"  # what the model would say, end of turn included
    assert s.loss_mask.all() and s.reward == 1.0 and (s.policy_version_start, s.turns) == (4, 1)
    assert set(timings) >= {"env_s", "score_s"}
    short = AnswerRunner(chat, 20, lambda: 0, reference_answers, "reference")
    with pytest.raises(RolloutError, match="reference answer are .* over inference.max_model_len=20"):
        await short.run(task, ReferenceEnv(), SamplingConfig(), max_turns=1)


async def test_a_chat_teachers_cut_off_or_empty_answer_fails_the_task_and_a_whole_one_is_trained_on(chat):
    class Teacher:
        def __init__(self, choices):
            self.choices, self.sent = choices, {}

        async def chat(self, messages, **fields):
            self.sent = fields
            return {"choices": self.choices}

    task = Task(task_id="e:0:0", env="e", example_index=7, example_id="7", group_size=1, mode="sft")
    whole = Teacher([{"message": {"content": "answer 7"}, "finish_reason": "stop"}])
    runner = AnswerRunner(chat, 512, lambda: 0, chat_answers(whole), "teacher")
    (s,), timings = await runner.run(task, ReferenceEnv(), SamplingConfig(extra_body={"top_k": 5}), 1)
    assert chat.tokenizer.decode(s.completion_ids) == "answer 7<|im_end|>" and s.reward == 1.0
    assert "teacher_s" in timings and "top_k" not in whole.sent and whole.sent["n"] == 1
    for bad in ({"message": {"content": None}, "finish_reason": "content_filter"},
                {"message": {"content": "answ"}, "finish_reason": "length"}):
        cut = AnswerRunner(chat, 512, lambda: 0, chat_answers(Teacher([bad])), "teacher")
        with pytest.raises(RolloutError, match="not a whole one"):
            await cut.run(task, ReferenceEnv(), SamplingConfig(), 1)
