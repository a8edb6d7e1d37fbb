"""What the inference engine is asked (:class:`Request`) and what it answers (:class:`Generation`, one
:class:`Choice` per sequence)."""

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.inference.sampling import SamplingParams


@dataclass
class Choice:
    """One generated sequence."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    text: str
    finish_reason: str
    """``stop`` (eos, stop token or stop string) or ``length``."""
    stop_reason: str | int | None


@dataclass
class Generation:
    """The answer to one request: ``n`` choices sharing one prompt."""

    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None
    """Per prompt token: None for the first, else {token id: (logprob, rank)} for the token and the top k."""
    choices: list[Choice]
    policy_version: int
    """Policy version when generation started (the oldest weights that produced a token)."""
    policy_version_end: int
    """Policy version when the last choice finished."""


@dataclass
class Request:
    """A queued request; set ``cancelled`` to drop its sequences at the next step."""

    prompt_ids: list[int]
    params: SamplingParams
    future: concurrent.futures.Future
    cancelled: bool = False
    choices: list[Choice | None] = field(default_factory=list)
    prompt_logprobs: list | None = None
    version: int = 0
    on_token: Callable[[int, int], None] | None = None
    """Called from the engine thread with (choice index, token id) after each sampled token that did not end its
    choice (streaming; the last comes with the choice's final text, which a stop string may have cut short)."""
    arrived: float = field(default_factory=time.monotonic)
    """``time.monotonic()`` when it was queued."""
