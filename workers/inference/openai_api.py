"""OpenAI request parsing and response shapes, with vLLM 0.32's field names.

Requests: ``n``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``max_tokens`` (chat also
``max_completion_tokens``), ``min_tokens``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``seed``,
``logprobs``, ``top_logprobs`` (chat), ``prompt_logprobs``, ``return_token_ids``; a completion prompt may
be text, a token id list, or a list of either. Responses carry vLLM's ``token_ids`` / ``prompt_token_ids``
and ``prompt_logprobs`` (first entry null, then ``{"<id>": {"logprob", "rank", "decoded_token"}}``), plus a
top-level ``policy_version`` (the weights version when generation started) and ``policy_version_end``.
"""

import math
import time
import uuid
from functools import lru_cache
from typing import Any

from workers.inference.generation import Choice, Generation
from workers.inference.sampling import SamplingParams

MAX_LOGPROBS = 20
"""Most top logprobs (``logprobs``, ``top_logprobs``, ``prompt_logprobs``) a request may ask (vLLM's default
``max_logprobs``)."""
MAX_TEMPERATURE = 100.0
"""Highest ``temperature`` accepted (past it every token is about equally likely)."""
SEED_RANGE = (-(2**63), 2**63 - 1)
"""``seed`` must fit a signed 64-bit integer (vLLM's bound)."""
MAX_STOPS = 64
"""Most ``stop`` strings, and (×16) ``stop_token_ids``, a request may give: each is checked at every step of its
rows, so an unbounded list slows the whole batch."""


class ApiError(Exception):
    """A request the server rejects; becomes an OpenAI-style error body with ``status`` and ``param`` (the request
    field at fault, if one is)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.headers = headers or {}


def sampling_params(body: dict[str, Any], *, chat: bool) -> SamplingParams:
    """The sampling parameters of a request body (vLLM defaults where a field is absent); every field is checked for
    its type and range here, so nothing out of range reaches the engine (an ApiError names the field)."""
    if body.get("stream"):
        given = [k for k in ("logprobs", "prompt_logprobs", "return_token_ids") if body.get(k)]
        if given:
            raise ApiError(f"stream=true streams text only; drop {', '.join(given)} or send stream=false")
    if chat:
        logprobs = _int(body, "top_logprobs", 0, 0, MAX_LOGPROBS) if _bool(body, "logprobs") else None
        tokens_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _int(body, tokens_name, None, 1, None)
    else:
        logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
        max_tokens = _int(body, "max_tokens", None, 1, None) if "max_tokens" in body else 16  # null: no cap
        tokens_name = "max_tokens"
    min_tokens = _int(body, "min_tokens", 0, 0, None)
    if max_tokens is not None and min_tokens > max_tokens:
        raise ApiError(f"min_tokens={min_tokens} is above {tokens_name}={max_tokens}", param="min_tokens")
    return SamplingParams(
        temperature=_float(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
        top_k=_int(body, "top_k", -1, -1, None),
        min_p=_float(body, "min_p", 0.0, 0.0, 1.0),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=_stop(body.get("stop")),
        stop_token_ids=tuple(_int({"stop_token_ids": t}, "stop_token_ids", 0, 0, None)
                             for t in _list(body, "stop_token_ids", 16 * MAX_STOPS)),
        ignore_eos=_bool(body, "ignore_eos"),
        seed=_int(body, "seed", None, *SEED_RANGE),
        n=_int(body, "n", 1, 1, None),
        logprobs=logprobs,
        prompt_logprobs=_int(body, "prompt_logprobs", None, 0, MAX_LOGPROBS),
    )


def _int(body: dict[str, Any], name: str, default: int | None, low: int, high: int | None) -> int | None:
    """``body[name]`` as an int in [low, high] (None or absent: ``default``)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"{name}={value!r} is not an integer", param=name)
    if value < low or (high is not None and value > high):
        raise ApiError(f"{name}={value} is outside [{low}, {'∞' if high is None else high}]", param=name)
    return value


def _float(body: dict[str, Any], name: str, default: float, low: float, high: float, open_low: bool = False) -> float:
    """``body[name]`` as a finite number in [low, high] ((low, high] with ``open_low``)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ApiError(f"{name}={value!r} is not a finite number", param=name)
    if value < low or value > high or (open_low and value == low):
        raise ApiError(f"{name}={value} is outside {'(' if open_low else '['}{low}, {high}]", param=name)
    return float(value)


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(f"{name}={value!r} is not true or false", param=name)
    return value


def _list(body: dict[str, Any], name: str, most: int) -> list:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ApiError(f"{name} must be a list, got {type(value).__name__}", param=name)
    if len(value) > most:
        raise ApiError(f"{name} has {len(value)} entries, more than the {most} accepted", param=name)
    return value


def _stop(value: Any) -> tuple[str, ...]:
    """``stop``: a string or a list of non-empty strings."""
    stops = [value] if isinstance(value, str) else _list({"stop": value}, "stop", MAX_STOPS)
    if not all(isinstance(s, str) and s for s in stops):
        raise ApiError(f"stop={value!r} must be a non-empty string or a list of them", param="stop")
    return tuple(stops)


def completion_prompts(body: dict[str, Any], tokenizer: Any) -> list[list[int]]:
    """The token ids of each prompt of a completion request (ids are checked against the vocabulary by the engine)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, add_special_tokens=True)]
    if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        return [p if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=True) for p in prompt]
    raise ApiError("prompt must be a string, a list of token ids, or a list of those", param="prompt")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_id(t) for t in value)


def chat_prompt(body: dict[str, Any], tokenizer: Any) -> list[int]:
    """The token ids of a chat request's messages under the model's chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {role, content} objects", param="messages")
    try:
        return list(tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
        ))
    except Exception as e:  # template errors name the problem; they are the caller's
        raise ApiError(f"chat template failed on these messages: {e}", param="messages") from e


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
            str(t): {"logprob": lp, "rank": rank, "decoded_token": self.token_text(t)}
            for t, (lp, rank) in entry.items()
        } for entry in gen.prompt_logprobs]


def error_body(message: str, status: int, policy_version: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's error shape, plus the policy version."""
    kind = {401: "AuthenticationError", 429: "RateLimitError"}.get(status, "BadRequestError")
    kind = kind if status < 500 else "InternalServerError"
    return {"error": {"message": message, "type": kind, "param": param, "code": status},
            "policy_version": policy_version}
