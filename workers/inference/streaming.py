"""``"stream": true``: server-sent events the way OpenAI's API (and vLLM) sends them.

Each event is ``data: {chunk}\\n\\n``; the stream ends with ``data: [DONE]\\n\\n``. Completion chunks are
``text_completion`` objects whose choices carry a ``text`` delta; chat chunks are ``chat.completion.chunk`` objects
whose first delta per choice is ``{"role": "assistant"}`` and later ones ``{"content": …}``. The last chunk of a
choice has its ``finish_reason``; ``stream_options.include_usage`` adds a final chunk with ``usage`` and no
choices. Every chunk carries ``policy_version`` (the weights when the request arrived), like the other responses.
Streams carry text only: ``logprobs``, ``prompt_logprobs`` and ``return_token_ids`` need ``stream = false``.
"""

import json
import time
import uuid
from typing import Any

from workers.inference.generation import Choice


class TextDelta:
    """One choice's text so far, from its token ids; :meth:`add` returns what is new and safe to send (held back:
    an unfinished UTF-8 character, and the last characters that could still start a stop string)."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        end = len(text.rstrip("\ufffd")) - self.hold
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta

    def finish(self, choice: Choice) -> str:
        """The rest of the final text (which a stop string may have cut short)."""
        delta = choice.text[self.sent:]
        self.sent = len(choice.text)
        return delta


class ChunkWriter:
    """The chunks of one streamed response."""

    def __init__(self, model: str, chat: bool, policy_version: int):
        self.chat = chat
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                     "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": model}
        self.policy_version = policy_version

    def start(self, index: int) -> bytes:
        """A chat choice's opening chunk (the role); nothing for completions."""
        if not self.chat:
            return b""
        return self._event([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def text(self, index: int, delta: str, finish: Choice | None = None) -> bytes:
        reason = None if finish is None else finish.finish_reason
        stop_reason = None if finish is None else finish.stop_reason
        if self.chat:
            body = {"index": index, "delta": {"content": delta} if delta else {}, "logprobs": None,
                    "finish_reason": reason, "stop_reason": stop_reason}
        else:
            body = {"index": index, "text": delta, "logprobs": None, "finish_reason": reason,
                    "stop_reason": stop_reason}
        return self._event([body])

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return self._event([], usage={"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                      "total_tokens": prompt_tokens + completion_tokens})

    def _event(self, choices: list[dict], **extra: Any) -> bytes:
        chunk = {**self.head, "choices": choices, **extra, "policy_version": self.policy_version}
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
"""The last event of every stream."""
