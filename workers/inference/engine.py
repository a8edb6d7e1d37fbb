"""Dynamic-batching generation with a KV cache, for any Hugging Face causal LM with full attention.

One engine thread owns the model. Each iteration it runs queued calls (weight loads), prefills the
requests that arrived since the last step (left-padded, one forward pass), merges their KV cache rows
into the running batch, then decodes one token for every active sequence in one forward pass. A
finished sequence leaves the batch at once; a new request joins at the next step.

An idle engine holds the first request that reaches it for up to ``batch_wait_s`` (from its arrival), so
that requests sent together but arriving a few milliseconds apart (a rollout worker starting a step's
groups) are prefilled in one pass and decode in step, not in staggered waves that each cost a forward
pass. A full batch's worth of queued sequences, or a call between steps (new weights), ends the wait at once,
and what is queued then is prefilled.

The batch's KV cache is left-aligned: row ``i`` holds its tokens at the right end of the time axis and
padding (masked out) on the left, so rows of different lengths decode together; columns that are padding
in every row are trimmed when sequences leave.

Failures: a step (prefill or decode) that raises fails the requests of its batch at once (:class:`EngineStepFailed`,
a 500 the client may retry), the batch is dropped and the engine goes on with the next requests: the model itself is
not changed by a forward pass, so the next step starts clean. :data:`FAILURES_IN_A_ROW` failed steps with no good one
between them mean a broken device (a CUDA error poisons every later call): the engine thread then ends, failing
every request it holds, and the server watching it exits so that its supervisor starts a fresh process.
Queued work is bounded: ``max_queued`` sequences (prompts × ``n``) may wait for a batch slot; past that a request is
refused whole (:class:`EngineOverloaded`, a 429).
"""

import concurrent.futures
import inspect
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from bus.log import get_logger
from workers.inference.engine_errors import BadRequest, EngineOverloaded, EngineStepFailed, EngineStopped
from workers.inference.generation import Choice, Generation, Request
from workers.inference.sampling import RowParams, SamplingParams, sample

FAILURES_IN_A_ROW = 3
"""Failed steps in a row after which the engine stops (the device is broken; a fresh process is needed)."""


@dataclass
class _Seq:
    request: Request
    index: int
    generator: torch.Generator | None
    out_ids: list[int] = field(default_factory=list)
    out_lps: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] | None = None
    checked_text: int = 0


class Engine:
    """Continuous batching over one model; thread-safe ``submit`` and ``call_between_steps``."""

    def __init__(self, model: Any, tokenizer: Any, *, max_batch_size: int, max_model_len: int,
                 eos_token_ids: set[int], policy_version: int = 0, max_queued: int | None = None,
                 batch_wait_s: float = 0.0):
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # transformers 5.2x renamed ``past_key_values`` to ``cache``; accept either.
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.policy_version = policy_version
        self.generated_tokens = 0
        self.steps = 0
        self.decode_s = 0.0
        """Seconds spent in decode steps (over ``steps``: the latency per generated token of a sequence)."""
        self.prefills = 0
        self.max_queued = max_queued
        """Sequences that may wait for a batch slot (None: no bound)."""
        self.batch_wait_s = batch_wait_s
        """How long an idle engine holds its first request for others to prefill with (0: not at all)."""
        self.queued_sequences = 0
        """Sequences waiting now."""
        self.failures = 0
        """Steps that failed (each failed its batch's requests)."""
        self._failed_in_row = 0
        self.log = get_logger(worker="inference-engine")
        self.error: BaseException | None = None
        self._pending: deque[Request] = deque()
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="inference-engine", daemon=True)
        self._reset_batch()

    # Public, thread-safe.

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def active(self) -> int:
        return len(self._seqs)

    @property
    def waiting(self) -> int:
        """Queued sequences beyond the free batch slots: those that wait for room, not just for the next step (nor
        for company, see ``batch_wait_s``). A request is admitted whole, so this may undercount by part of one."""
        return max(0, self.queued_sequences - (self.max_batch_size - len(self._seqs)))

    @property
    def queued(self) -> int:
        """Requests not yet in the running batch: waiting for room, for the next step or for company (as vLLM's
        ``num_requests_waiting``; :attr:`waiting` counts only the sequences that wait for room)."""
        return len(self._pending)

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_token: Callable[[int, int], None] | None = None) -> Request:
        """Queue a request; ``request.future`` resolves to a :class:`Generation`; ``on_token(choice, token)`` sees
        each token as it is sampled (from the engine's thread: hand it over, do not block)."""
        on_prompt = None if on_token is None else (lambda _, j, t: on_token(j, t))
        return self.submit_all([prompt_ids], params, on_prompt)[0]

    def submit_all(self, prompts: list[list[int]], params: SamplingParams,
                   on_token: Callable[[int, int, int], None] | None = None) -> list[Request]:
        """Queue one request per prompt, all or none (:class:`BadRequest` for what can never be served,
        :class:`EngineOverloaded` when the queue is full); ``on_token(prompt, choice, token)`` as in :meth:`submit`."""
        for prompt_ids in prompts:
            self._check(prompt_ids, params)
        count = len(prompts) * params.n
        if self.max_queued is not None and count > self.max_queued:
            raise BadRequest(f"the request asks for {count} sequences (prompts × n), more than "
                             f"inference.max_queued_sequences={self.max_queued} can ever queue; split it", "prompt")
        requests = [Request(list(p), params, concurrent.futures.Future(), choices=[None] * params.n,
                            on_token=None if on_token is None else (lambda j, t, i=i: on_token(i, j, t)))
                    for i, p in enumerate(prompts)]
        with self._cond:
            if self.error is not None or self._stop:
                raise EngineStopped(f"inference engine is not running: {self.error!r}")
            if self.max_queued is not None and self.queued_sequences + count > self.max_queued:
                raise EngineOverloaded(f"{self.queued_sequences} sequences wait already "
                                       f"(inference.max_queued_sequences={self.max_queued}); retry later")
            self._pending.extend(requests)
            self.queued_sequences += count
            self._cond.notify()
        return requests

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise :class:`BadRequest` unless the prompt and parameters fit this model and engine."""
        if not prompt_ids:
            raise BadRequest("the prompt is empty; send at least one token", "prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise BadRequest(f"prompt of {len(prompt_ids)} tokens leaves no room within max_model_len="
                             f"{self.max_model_len}; shorten it or raise inference.max_model_len", "prompt")
        if params.max_tokens is not None and len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise BadRequest(f"prompt ({len(prompt_ids)} tokens) + max_tokens={params.max_tokens} exceeds "
                             f"max_model_len={self.max_model_len}; lower max_tokens", "max_tokens")
        if params.n > self.max_batch_size:
            raise BadRequest(f"n={params.n} exceeds inference.max_batch_size={self.max_batch_size}", "n")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "prompt")
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})", "stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and not 0 <= k <= vocab:
                raise BadRequest(f"{name}={k} is outside [0, {vocab}] (the vocabulary)", name)

    def call_between_steps(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the engine thread between two decode steps (e.g. load new weights in place)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    # Engine thread.

    def _loop(self) -> None:
        new: list[Request] = []
        try:
            with torch.inference_mode():
                while True:
                    calls, new = self._wait_for_work()
                    if calls is None:
                        break
                    for fn, future in calls:
                        _run_call(fn, future)
                    self._drop_cancelled()
                    try:
                        if new:
                            self._prefill(new)
                        if self._seqs:
                            started = time.perf_counter()
                            self._decode()
                            self.decode_s += time.perf_counter() - started
                        self._failed_in_row = 0
                    except Exception as e:  # the step's requests fail; the engine goes on (or stops, see below)
                        self._step_failed(e, new)
        except BaseException as e:  # the engine is dead: fail every waiting request
            self.error = e
            self.log.error("engine_stopped", error=repr(e), failures=self.failures)
            with self._cond:
                waiting = list(self._pending)
                self._pending.clear()
                self.queued_sequences = 0
            self._fail([s.request for s in self._seqs] + new + waiting, RuntimeError(f"inference engine failed: {e!r}"))
            # The thread ends here (logged, kept in ``error``); the server's watcher sees it and exits.

    def _step_failed(self, error: Exception, new: list[Request]) -> None:
        """Fail the requests of the batch (new and running), drop the batch; re-raise after too many in a row."""
        requests = list({id(r): r for r in new + [s.request for s in self._seqs]}.values())
        self.failures += 1
        self._failed_in_row += 1
        self._reset_batch()
        self._fail(requests, EngineStepFailed(f"the inference engine failed on this request's batch: {error!r}; "
                                              "the batch was dropped, retry"))
        self.log.error("engine_step_failed", error=repr(error), requests=len(requests), failures=self.failures,
                       in_a_row=self._failed_in_row)
        if self._failed_in_row >= FAILURES_IN_A_ROW:
            raise RuntimeError(f"{self._failed_in_row} engine steps failed in a row, the last with {error!r}; "
                               "the device looks broken") from error

    @staticmethod
    def _fail(requests: list[Request], error: Exception) -> None:
        for request in requests:
            if not request.future.done():
                request.future.set_exception(error)

    def _wait_for_work(self) -> tuple[list | None, list[Request]]:
        with self._cond:
            while not self._stop and not self._calls and not self._pending and not self._seqs:
                self._cond.wait()
            if not self._seqs:
                self._hold_for_company()
            if self._stop:
                return None, []
            calls = list(self._calls)
            self._calls.clear()
            new: list[Request] = []
            room = self.max_batch_size - len(self._seqs)
            while self._pending and self._pending[0].params.n <= room:
                request = self._pending.popleft()
                self.queued_sequences -= request.params.n
                if request.cancelled:
                    continue
                new.append(request)
                room -= request.params.n
            return calls, new

    def _hold_for_company(self) -> None:
        """Wait (holding ``_cond``) until ``batch_wait_s`` after the first queued request arrived, unless a batch's
        worth of sequences is queued first, a call between steps comes, or the engine stops."""
        if not self._pending or self.batch_wait_s <= 0:
            return
        deadline = self._pending[0].arrived + self.batch_wait_s
        while not self._stop and not self._calls and self.queued_sequences < self.max_batch_size:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _reset_batch(self) -> None:
        self._seqs: list[_Seq] = []
        self._cache = DynamicCache(config=self.model.config)
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self._next_pos = torch.zeros(0, dtype=torch.long, device=self.device)
        self._last = torch.zeros(0, dtype=torch.long, device=self.device)
        self._rows: RowParams | None = None

    def _prefill(self, requests: list[Request]) -> None:
        self.prefills += 1
        lengths = [len(r.prompt_ids) for r in requests]
        width = max(lengths)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - lengths[i]:] = torch.tensor(r.prompt_ids)
            mask[i, width - lengths[i]:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        want_prompt = any(r.params.prompt_logprobs is not None for r in requests)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **{self._cache_arg: cache}, logits_to_keep=0 if want_prompt else 1)
        for i, r in enumerate(requests):
            r.version = self.policy_version
            if r.params.prompt_logprobs is not None:
                r.prompt_logprobs = _prompt_logprobs(out.logits[i, width - lengths[i]:], r.prompt_ids,
                                                     r.params.prompt_logprobs)
        rows = torch.repeat_interleave(torch.arange(len(requests)), torch.tensor([r.params.n for r in requests]))
        seqs = [_Seq(r, j, _generator(r.params.seed, j)) for r in requests for j in range(r.params.n)]
        rows_dev = rows.to(self.device)
        last_logits = out.logits[:, -1].index_select(0, rows_dev)
        new_pos = torch.tensor(lengths, device=self.device).index_select(0, rows_dev)
        self._merge(seqs, _layers(cache), mask.index_select(0, rows_dev), new_pos, rows_dev)
        params = RowParams.build([s.request.params for s in seqs], [s.generator for s in seqs])
        tokens, chosen, full = sample(last_logits, params)
        start = len(self._seqs) - len(seqs)
        self._last[start:] = tokens
        self._rows = None
        self._record(seqs, tokens, chosen, full, offset=start)

    def _merge(self, seqs: list[_Seq], layers: list[DynamicLayer], mask: torch.Tensor,
               next_pos: torch.Tensor, rows: torch.Tensor) -> None:
        """Append new rows (KV cache, mask, positions) to the batch, left-padding the shorter side."""
        old_width, new_width = self._mask.shape[1], mask.shape[1]
        width = max(old_width, new_width)
        mine = _layers(self._cache)
        for layer, new in zip(mine, layers, strict=True):
            keys, values = new.keys.index_select(0, rows), new.values.index_select(0, rows)
            if self._seqs:
                keys = torch.cat([_pad_time(layer.keys, width), _pad_time(keys, width)], dim=0)
                values = torch.cat([_pad_time(layer.values, width), _pad_time(values, width)], dim=0)
            else:
                layer.is_initialized = True
            layer.keys, layer.values = keys, values
        self._mask = torch.cat([F.pad(self._mask, (width - old_width, 0)), F.pad(mask, (width - new_width, 0))])
        self._next_pos = torch.cat([self._next_pos, next_pos])
        self._last = torch.cat([self._last, torch.zeros(len(seqs), dtype=torch.long, device=self.device)])
        self._seqs.extend(seqs)

    def _decode(self) -> None:
        if self._rows is None:
            self._rows = RowParams.build([s.request.params for s in self._seqs], [s.generator for s in self._seqs])
        batch = len(self._seqs)
        self._mask = torch.cat([self._mask, torch.ones((batch, 1), dtype=torch.long, device=self.device)], dim=1)
        out = self.model(input_ids=self._last[:, None], attention_mask=self._mask,
                         position_ids=self._next_pos[:, None], use_cache=True,
                         **{self._cache_arg: self._cache})
        self._next_pos += 1
        tokens, chosen, full = sample(out.logits[:, -1], self._rows)
        self._last = tokens
        self.steps += 1
        self._record(list(self._seqs), tokens, chosen, full, offset=0)

    def _record(self, seqs: list[_Seq], tokens: torch.Tensor, chosen: torch.Tensor, full: torch.Tensor,
                offset: int) -> None:
        """Append each row's token, finish the sequences that are done, and drop them from the batch."""
        token_list, lp_list = tokens.tolist(), chosen.tolist()
        self.generated_tokens += len(token_list)
        done = []
        for i, seq in enumerate(seqs):
            seq.out_ids.append(token_list[i])
            seq.out_lps.append(lp_list[i])
            k = seq.request.params.logprobs
            if k:
                values, ids = torch.topk(full[i], k)
                if seq.tops is None:
                    seq.tops = []
                seq.tops.append(list(zip(ids.tolist(), values.tolist(), strict=True)))
            choice = self._finished(seq)
            if choice is not None:
                done.append((offset + i, seq, choice))
            elif seq.request.on_token is not None:
                seq.request.on_token(seq.index, token_list[i])
        if done:  # out of the batch before their callers hear of it, so ``active`` never counts a finished one
            self._remove({i for i, _, _ in done})
            for _, seq, choice in done:
                self._complete(seq, choice)

    def _finished(self, seq: _Seq) -> Choice | None:
        p = seq.request.params
        token, count = seq.out_ids[-1], len(seq.out_ids)
        reason: str | None = None
        stop_reason: str | int | None = None
        text_end: int | None = None
        text: str | None = None
        if count > p.min_tokens and token in p.stop_token_ids:
            reason, stop_reason = "stop", token
        elif count > p.min_tokens and not p.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif p.stop and count > p.min_tokens:
            text = self.tokenizer.decode(seq.out_ids, skip_special_tokens=True)
            start = max(0, seq.checked_text - max(len(s) for s in p.stop))
            hits = [(at, s) for s in p.stop if (at := text.find(s, start)) >= 0]
            seq.checked_text = len(text)
            if hits:
                text_end, stop_reason = min(hits)
                reason = "stop"
        if reason is None and ((p.max_tokens is not None and count >= p.max_tokens)
                               or len(seq.request.prompt_ids) + count >= self.max_model_len):
            reason = "length"
        if reason is None:
            return None
        if text is None:
            text = self.tokenizer.decode(seq.out_ids, skip_special_tokens=True)
        return Choice(seq.out_ids, seq.out_lps, seq.tops, text[:text_end] if text_end is not None else text,
                      reason, stop_reason)

    def _complete(self, seq: _Seq, choice: Choice) -> None:
        request = seq.request
        request.choices[seq.index] = choice
        if all(c is not None for c in request.choices) and not request.future.done():
            request.future.set_result(Generation(request.prompt_ids, request.prompt_logprobs, request.choices,
                                                 request.version, self.policy_version))

    def _drop_cancelled(self) -> None:
        gone = {i for i, s in enumerate(self._seqs) if s.request.cancelled}
        if gone:
            self._remove(gone)

    def _remove(self, gone: set[int]) -> None:
        keep = [i for i in range(len(self._seqs)) if i not in gone]
        if not keep:
            self._reset_batch()
            return
        index = torch.tensor(keep, device=self.device)
        mask = self._mask.index_select(0, index)
        first = int(mask.any(0).nonzero()[0])  # columns left of this are padding in every kept row
        for layer in _layers(self._cache):
            layer.keys = layer.keys.index_select(0, index)[:, :, first:]
            layer.values = layer.values.index_select(0, index)[:, :, first:]
        self._mask = mask[:, first:]
        self._next_pos = self._next_pos.index_select(0, index)
        self._last = self._last.index_select(0, index)
        self._seqs = [self._seqs[i] for i in keep]
        self._rows = None


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise TypeError(
                f"the built-in inference server needs full-attention cache layers, got {type(layer).__name__}; "
                "use inference.backend = 'vllm' for this model"
            )
    return cache.layers


def _pad_time(x: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad the time axis (dim 2 of [B, H, T, D]) with zeros to ``width``."""
    return F.pad(x, (0, 0, width - x.shape[2], 0)) if x.shape[2] < width else x


def _generator(seed: int | None, index: int) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator().manual_seed((seed + index) % 2**64)  # any int64 seed, + index, wraps


def _prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], k: int) -> list[dict[int, tuple[float, int]] | None]:
    """Logprob and rank (1 = most likely) of each prompt token given the ones before it, plus the top k."""
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    targets = torch.tensor(prompt_ids[1:], device=logprobs.device)
    chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
    ranks = (logprobs > chosen[:, None]).sum(-1) + 1
    out: list[dict[int, tuple[float, int]] | None] = [None]
    top_values, top_ids = torch.topk(logprobs, k) if k else (None, None)
    for t, (token, lp, rank) in enumerate(zip(prompt_ids[1:], chosen.tolist(), ranks.tolist(), strict=True)):
        entry = {token: (lp, rank)}
        if k:
            for r, (tid, value) in enumerate(zip(top_ids[t].tolist(), top_values[t].tolist(), strict=True)):
                entry.setdefault(tid, (value, r + 1))
        out.append(entry)
    return out


def _run_call(fn: Callable[[], Any], future: concurrent.futures.Future) -> None:
    try:
        future.set_result(fn())
    except Exception as e:  # the caller decides; the engine keeps serving
        future.set_exception(e)

