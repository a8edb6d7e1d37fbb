"""The token-in/token-out route vLLM serves and verifiers' train client calls: ``POST /inference/v1/generate``.

Request (vLLM's shape)::

    {"model": "...", "token_ids": [1, 2, 3], "cache_salt": "...",
     "sampling_params": {"temperature": 1.0, "max_tokens": 64, "stop_token_ids": [7], "logprobs": 1, ...}}

Response: ``{"request_id", "model", "prompt_token_ids", "choices": [{"index", "token_ids", "finish_reason",
"logprobs": {"content": [{"token": "token_id:N", "logprob": x}, ...]}}], "policy_version", "policy_version_end"}``:
one logprob entry per sampled token, the token written ``token_id:N`` (what ``renderers.client`` checks), so the
caller gets exactly the ids it trains on with no detokenize/retokenize round trip. ``cache_salt`` is accepted and
ignored (the built-in engine has no prefix cache to salt); ``skip_special_tokens`` and ``detokenize`` likewise.
"""

import uuid
from typing import Any

from workers.inference.generation import Generation
from workers.inference.openai_api import ApiError, sampling_params

IGNORED = frozenset({"skip_special_tokens", "spaces_between_special_tokens", "detokenize", "include_stop_str_in_output",
                     "routed_experts_prompt_start", "repetition_penalty", "presence_penalty", "frequency_penalty"})
"""vLLM sampling fields accepted and ignored (penalties only at their neutral values; see :func:`generate_params`)."""

NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def generate_request(body: dict[str, Any]) -> tuple[list[int], Any]:
    """The prompt ids and sampling parameters of a generate request body; ApiError when it is malformed."""
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ApiError("token_ids must be a non-empty list of integer token ids")
    raw = body.get("sampling_params") or {}
    if not isinstance(raw, dict):
        raise ApiError("sampling_params must be an object")
    for name, neutral in NEUTRAL.items():
        if raw.get(name, neutral) != neutral:
            raise ApiError(f"{name}={raw[name]} is not supported by the built-in server; leave it at {neutral}")
    known = {"n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop", "stop_token_ids",
             "ignore_eos", "seed", "logprobs", "prompt_logprobs"}
    unknown = sorted(set(raw) - known - IGNORED)
    if unknown:
        raise ApiError(f"unsupported sampling_params {unknown}; the built-in server takes {sorted(known)}")
    fields = {k: v for k, v in raw.items() if k in known}
    fields["logprobs"] = 0 if fields.get("logprobs") is not None else None
    fields.setdefault("max_tokens", None)
    return list(ids), sampling_params(fields, chat=False)


def generate_response(gen: Generation, model: str) -> dict[str, Any]:
    """vLLM's generate response for one generation (its ``n`` choices)."""
    return {
        "request_id": f"gen-{uuid.uuid4().hex}",
        "model": model,
        "prompt_token_ids": list(gen.prompt_token_ids),
        "choices": [{
            "index": j,
            "token_ids": list(c.token_ids),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": float(lp)}
                                     for t, lp in zip(c.token_ids, c.logprobs, strict=True)]},
        } for j, c in enumerate(gen.choices)],
        "usage": {"prompt_tokens": len(gen.prompt_token_ids),
                  "completion_tokens": sum(len(c.token_ids) for c in gen.choices)},
        "policy_version": gen.policy_version,
        "policy_version_end": gen.policy_version_end,
    }
