"""OpenAI request parsing and response shapes, with vLLM 0.32's field names.

Requests: ``n``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``max_tokens`` (chat also
``max_completion_tokens``), ``min_tokens``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``seed``,
``logprobs``, ``top_logprobs`` (chat), ``prompt_logprobs``, ``return_token_ids``; a completion prompt may
be text, a token id list, or a list of either. Responses carry vLLM's ``token_ids`` / ``prompt_token_ids``
and ``prompt_logprobs`` (first entry null, then ``{"<id>": {"logprob", "rank", "decoded_token"}}``), plus a
top-level ``policy_version`` (the weights version when generation started) and ``policy_version_end``.
"""

import time
import uuid
from functools import lru_cache
from typing import Any

from workers.inference.engine import Choice, Generation
from workers.inference.sampling import SamplingParams


class ApiError(Exception):
    """A request the server rejects; becomes an OpenAI-style error body with ``status``."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def sampling_params(body: dict[str, Any], *, chat: bool) -> SamplingParams:
    """The sampling parameters of a request body (vLLM defaults where a field is absent)."""
    if body.get("stream"):
        given = [k for k in ("logprobs", "prompt_logprobs", "return_token_ids") if body.get(k)]
        if given:
            raise ApiError(f"stream=true streams text only; drop {', '.join(given)} or send stream=false")
    stop = body.get("stop") or ()
    logprobs = body.get("logprobs")
    if chat:
        logprobs = int(body.get("top_logprobs") or 0) if logprobs else None
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        logprobs = None if logprobs is None else int(logprobs)
        max_tokens = body.get("max_tokens", 16)
    params = SamplingParams(
        temperature=_number(body, "temperature", 1.0, low=0.0),
        top_p=_number(body, "top_p", 1.0, low=0.0),
        top_k=int(_number(body, "top_k", -1, low=-1)),
        min_p=_number(body, "min_p", 0.0, low=0.0),
        max_tokens=None if max_tokens is None else int(_number({"max_tokens": max_tokens}, "max_tokens", 16, low=1)),
        min_tokens=int(_number(body, "min_tokens", 0, low=0)),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(int(t) for t in body.get("stop_token_ids") or ()),
        ignore_eos=bool(body.get("ignore_eos", False)),
        seed=None if body.get("seed") is None else int(body["seed"]),
        n=int(_number(body, "n", 1, low=1)),
        logprobs=logprobs,
        prompt_logprobs=None if body.get("prompt_logprobs") is None else int(body["prompt_logprobs"]),
    )
    if params.top_p == 0 or params.top_p > 1:
        raise ApiError(f"top_p={params.top_p} must be in (0, 1]")
    if params.min_p > 1:
        raise ApiError(f"min_p={params.min_p} must be in [0, 1]")
    return params


def _number(body: dict[str, Any], name: str, default: float, *, low: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(f"{name}={value!r} is not a number")
    if value < low:
        raise ApiError(f"{name}={value} is below its minimum {low}")
    return value


def completion_prompts(body: dict[str, Any], tokenizer: Any) -> list[list[int]]:
    """The token ids of each prompt of a completion request."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, add_special_tokens=True)]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return [p if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=True) for p in prompt]
    raise ApiError("prompt must be a string, a list of token ids, or a list of those")


def chat_prompt(body: dict[str, Any], tokenizer: Any) -> list[int]:
    """The token ids of a chat request's messages under the model's chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {role, content} objects")
    try:
        return list(tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
        ))
    except Exception as e:  # template errors name the problem; they are the caller's
        raise ApiError(f"chat template failed on these messages: {e}") from e


class Renderer:
    """Turns generations into response bodies (token strings cached per id)."""

    def __init__(self, tokenizer: Any, model_name: str):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.token_text = lru_cache(maxsize=65536)(lambda t: tokenizer.decode([t]))

    def completion(self, gens: list[Generation], body: dict[str, Any]) -> dict[str, Any]:
        ids = bool(body.get("return_token_ids"))
        choices = []
        for p, gen in enumerate(gens):
            for j, c in enumerate(gen.choices):
                choices.append({
                    "index": p * len(gen.choices) + j,
                    "text": c.text,
                    "logprobs": self._completion_logprobs(c) if body.get("logprobs") is not None else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "token_ids": c.token_ids if ids else None,
                    "prompt_token_ids": gen.prompt_token_ids if ids else None,
                    "prompt_logprobs": self._prompt_logprobs(gen),
                })
        return self._envelope("cmpl", "text_completion", choices, gens)

    def chat(self, gen: Generation, body: dict[str, Any]) -> dict[str, Any]:
        ids = bool(body.get("return_token_ids"))
        choices = [{
            "index": j,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": {"content": self._chat_logprobs(c)} if body.get("logprobs") else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "token_ids": c.token_ids if ids else None,
        } for j, c in enumerate(gen.choices)]
        out = self._envelope("chatcmpl", "chat.completion", choices, [gen])
        out["prompt_token_ids"] = gen.prompt_token_ids if ids else None
        out["prompt_logprobs"] = self._prompt_logprobs(gen)
        return out

    def _envelope(self, prefix: str, kind: str, choices: list[dict], gens: list[Generation]) -> dict[str, Any]:
        prompt_tokens = sum(len(g.prompt_token_ids) for g in gens)
        completion_tokens = sum(len(c.token_ids) for g in gens for c in g.choices)
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "policy_version": min(g.policy_version for g in gens),
            "policy_version_end": max(g.policy_version_end for g in gens),
        }

    def _completion_logprobs(self, c: Choice) -> dict[str, Any]:
        tokens = [self.token_text(t) for t in c.token_ids]
        offsets, at = [], 0
        for text in tokens:
            offsets.append(at)
            at += len(text)
        tops = None
        if c.top_logprobs is not None:
            tops = [{self.token_text(t): lp for t, lp in step} for step in c.top_logprobs]
        return {"text_offset": offsets, "token_logprobs": c.logprobs, "tokens": tokens, "top_logprobs": tops}

    def _chat_logprobs(self, c: Choice) -> list[dict[str, Any]]:
        out = []
        for i, (token, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            top = c.top_logprobs[i] if c.top_logprobs is not None else []
            out.append({"token": self.token_text(token), "logprob": lp, "bytes": self._bytes(token),
                        "top_logprobs": [{"token": self.token_text(t), "logprob": v, "bytes": self._bytes(t)}
                                         for t, v in top]})
        return out

    def _bytes(self, token: int) -> list[int]:
        return list(self.token_text(token).encode("utf-8", errors="replace"))

    def _prompt_logprobs(self, gen: Generation) -> list[dict[str, dict[str, Any]] | None] | None:
        if gen.prompt_logprobs is None:
            return None
        return [None if entry is None else {
            str(t): {"logprob": lp, "rank": rank, "decoded_token": self.token_text(t)} for t, (lp, rank) in entry.items()
        } for entry in gen.prompt_logprobs]


def error_body(message: str, status: int, policy_version: int) -> dict[str, Any]:
    """vLLM's error shape, plus the policy version."""
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return {"error": {"message": message, "type": kind, "param": None, "code": status},
            "policy_version": policy_version}
