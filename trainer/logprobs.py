"""Token logprobs and entropy of packed samples, computed in chunks over the sequence.

The head's ``[tokens, vocab]`` fp32 logits are never materialised at once: :class:`ChunkedLogprobs`
computes ``chunk_size`` rows at a time. Where one ``[tokens, vocab]`` tensor fits ``keep_bytes``
(``trainer.logits_keep_mb``), the forward pass keeps each chunk's gradient with respect to its logits and the
backward pass is two matmuls a chunk; otherwise the backward recomputes each chunk's logits, so logits memory
is ``chunk_size × vocab`` whatever the sequence length (the 150k-vocab case on GPU). Logits are divided by
each token's sampling temperature before the softmax.

Packed samples never attend across their boundaries: position ids restart at 0 per sample and
transformers (SDPA attention, no 2-D attention mask) turns that into a block-diagonal causal mask.
Samples that share a prompt (``MicroBatch.shared_prompt_lengths``) need more than that: :func:`packed_layout`
gives the attention mask (each token sees its own sample's earlier tokens and the prompt it shares) and the
position each token is predicted from. ``tests/trainer/test_logprobs.py`` checks packed == unpacked logprobs and
gradients; ``tests/trainer/test_shared_prompts.py`` checks a step with shared prompts against one without.
"""

from dataclasses import dataclass

import torch
from torch import Tensor, nn


def chunk_logits(hidden: Tensor, weight: Tensor, inv_temp: Tensor) -> Tensor:
    """``z = h Wᵀ / τ`` of one chunk, ``[n, V]`` fp32. In fp32 the 1/τ row scale goes on hidden ``[n, H]`` (H ≪ V:
    the same numbers, a pass over the logits less); in a lower precision it stays fp32, on the logits."""
    if hidden.dtype == torch.float32:
        return (hidden * inv_temp[:, None]) @ weight.t()
    return (hidden @ weight.t()).float() * inv_temp[:, None]


def chunk_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: Tensor,
                   keep: str) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """One chunk's ``(logprob of target, entropy, logsumexp, kept)``, the first three ``[n]`` fp32, from hidden
    ``[n, H]``.

    ``kept`` is what the backward pass needs of the ``[n, V]`` logits, so it need not recompute them: with
    ``keep = "dlogp"``, ``d logp[target] / d z = onehot(target) − p`` in the weight's dtype (a logprob-only
    backward); with ``"logits"``, ``z`` itself (an entropy backward); with ``"none"``, nothing.
    """
    z = chunk_logits(hidden, weight, inv_temp)
    lse = z.logsumexp(-1)
    logprob = z.gather(-1, targets[:, None])[:, 0] - lse
    probs = (z - lse[:, None]).exp_()
    entropy = lse - (probs * z).sum(-1)
    if keep == "dlogp":
        return logprob, entropy, lse, onehot_minus(probs, targets).to(weight.dtype)
    return logprob, entropy, lse, z if keep == "logits" else None


def onehot_minus(probs: Tensor, targets: Tensor) -> Tensor:
    """``onehot(target) − p``, in place of ``probs``."""
    return probs.neg_().scatter_add_(-1, targets[:, None], torch.ones_like(probs[:, :1]))


def chunk_logits_grad(z: Tensor, lse: Tensor, entropy: Tensor, targets: Tensor, grad_logprob: Tensor,
                      grad_entropy: Tensor | None) -> Tensor:
    """``d(Σ grad_logprob · logp + Σ grad_entropy · H) / dz`` of one chunk, ``[n, V]`` fp32, from its logits.

    ``d logp[target] / dz = onehot(target) − p`` and ``d H / dz = −p · (log p + H)``. Without ``grad_entropy`` the
    result is ``onehot(target) − p``, unscaled: the caller scales its rows by ``grad_logprob`` on the ``[n, H]``
    side of the matmuls, which is cheaper.
    """
    logp = z - lse[:, None]
    probs = logp.exp()
    if grad_entropy is None:
        return onehot_minus(probs, targets)
    grad = probs.mul_(-(grad_logprob[:, None] + grad_entropy[:, None] * (logp + entropy[:, None])))
    return grad.scatter_add_(-1, targets[:, None], grad_logprob[:, None])


class ChunkedLogprobs(torch.autograd.Function):
    """``log softmax(h Wᵀ / τ)[target]`` and the entropy of that distribution, chunk by chunk.

    Shapes: hidden ``[T, H]``, weight ``[V, H]``, targets ``[T]`` (int64), inv_temp ``[T]`` (fp32)
    → logprobs ``[T]`` fp32 (differentiable) and entropy ``[T]`` fp32, differentiable only with ``entropy_grad``
    (``trainer.entropy_coef``; otherwise a metric, and its backward does no extra work).
    When the kept ``[T, V]`` tensor (see :func:`chunk_logprobs`) fits ``keep_bytes``, the forward keeps it and the
    backward is two matmuls per chunk; otherwise the backward recomputes each chunk's logits.
    ``fns`` is ``(chunk_logprobs, chunk_logits_grad)`` or torch.compiled versions of them (one
    fused kernel per chunk instead of a dozen passes over ``[chunk, V]`` fp32).
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: Tensor, chunk_size: int, fns,
                entropy_grad: bool = False, keep_bytes: int = 0):
        n, vocab = hidden.shape[0], weight.shape[0]
        keep = "logits" if entropy_grad else "dlogp"
        if n * vocab * (4 if entropy_grad else weight.element_size()) > keep_bytes:
            keep = "none"
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ctx.kept = []
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            logprobs[start:end], entropy[start:end], lse[start:end], kept = fns[0](
                hidden[start:end], weight, targets[start:end], inv_temp[start:end], keep)
            ctx.kept.append(kept)
        ctx.save_for_backward(hidden, weight, targets, inv_temp, lse, entropy)
        ctx.chunk_size, ctx.fns, ctx.entropy_grad, ctx.keep = chunk_size, fns, entropy_grad, keep
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor, grad_entropy: Tensor):
        hidden, weight, targets, inv_temp, lse, entropy = ctx.saved_tensors
        if not ctx.entropy_grad:
            grad_entropy = None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                       if ctx.needs_input_grad[1] else None)
        for i, start in enumerate(range(0, hidden.shape[0], ctx.chunk_size)):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            h, kept = hidden[start:end], ctx.kept[i]
            if ctx.keep != "dlogp":
                z = kept if ctx.keep == "logits" else chunk_logits(h, weight, inv_temp[start:end])
                kept = ctx.fns[1](z, lse[start:end], entropy[start:end], targets[start:end],
                                  grad_logprobs[start:end], None if grad_entropy is None else grad_entropy[start:end])
                kept = kept.to(weight.dtype)
            # Row factors of d/dz (1/τ, and d/dlogp unless the entropy's gradient is already in it) applied to the
            # [n, H] side: grad_h = (G W) · r, grad_W = Gᵀ (h · r).
            rows = inv_temp[start:end] if grad_entropy is not None else grad_logprobs[start:end] * inv_temp[start:end]
            if grad_hidden is not None:
                grad_hidden[start:end] = (kept @ weight) * rows[:, None]
            if grad_weight is not None:
                grad_weight += (kept.t() @ (h * rows[:, None]).to(weight.dtype)).float()
        ctx.kept = []
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def packed_layout(lengths: Tensor, shared: Tensor, width: int | None = None) -> tuple[Tensor, Tensor]:
    """``(attention mask [T, T] bool, sources [T] int64)`` of packed samples with shared prompts; with ``width``,
    of rows of ``width`` tokens that the samples fill in order (none across a row's end): ``[R, W, W]`` and
    ``[R, W]``, each row laid out on its own.

    ``lengths`` ``[k]`` are the tokens each sample holds, ``shared`` ``[k]`` the prompt tokens it reads from its
    holder (the nearest earlier sample of its row sharing none; see ``MicroBatch.shared_prompt_lengths``). Token
    ``t`` attends to its own sample's tokens up to ``t`` and to the first ``shared`` tokens of its sample's holder;
    ``sources[t]`` is the token whose hidden state predicts it (``t − 1``; for the first token of a sample that
    shares, the holder's token ``shared − 1``; −1 for the first token of one that does not).
    """
    k = len(lengths)
    device = lengths.device
    total = int(lengths.sum())
    w = total if width is None else width
    starts = lengths.cumsum(0) - lengths
    local = starts % w  # each sample's first token in its row
    samples = torch.arange(k, device=device)
    holders = torch.where((shared == 0) | (local == 0), samples, 0).cummax(0).values
    sample_of = torch.repeat_interleave(samples, lengths, output_size=total).view(-1, w)
    low = torch.repeat_interleave(local[holders], lengths, output_size=total).view(-1, w)
    high = low + torch.repeat_interleave(shared, lengths, output_size=total).view(-1, w)
    t = torch.arange(w, device=device)
    own = (sample_of[:, :, None] == sample_of[:, None, :]) & (t[None, :] <= t[:, None])
    mask = own | ((t >= low[:, :, None]) & (t < high[:, :, None]))
    sources = (t - 1).repeat(len(mask))
    sources[starts] = torch.where(shared > 0, local[holders] + shared - 1, -1)
    sources = sources.view(-1, w)
    return (mask[0], sources[0]) if width is None else (mask, sources)


@dataclass
class TokenLogprobs:
    """Per-token outputs of :class:`PolicyModel`, aligned with ``input_ids`` (entry 0 of each sample is 0)."""

    logprobs: Tensor
    """``[T]`` fp32 logprob of token t given the sample's tokens before it (differentiable)."""
    entropy: Tensor
    """``[T]`` fp32 entropy of the distribution token t was drawn from (differentiable)."""


class PolicyModel(nn.Module):
    """A causal LM whose forward returns token logprobs of a packed sequence instead of logits.

    Works for any transformers causal LM whose output head is a bias-free ``nn.Linear``
    (tied or not). ``lm`` stays reachable as ``.lm`` (its state dict is the Hugging Face one).
    """

    def __init__(self, lm: nn.Module, chunk_size: int = 1024, compile_head: bool = False, entropy_grad: bool = False,
                 keep_bytes: int = 0):
        super().__init__()
        head = lm.get_output_embeddings()
        if not isinstance(head, nn.Linear) or head.bias is not None:
            raise ValueError(f"{type(lm).__name__}: output head {type(head).__name__} is not a bias-free Linear")
        self.lm = lm
        self.chunk_size = chunk_size
        self.entropy_grad = entropy_grad
        """Whether the entropy is differentiable (a loss uses it: ``trainer.entropy_coef``)."""
        self.keep_bytes = keep_bytes
        """Bytes the head may keep from forward to backward (see :class:`ChunkedLogprobs`); none without grad."""
        fns = (chunk_logprobs, chunk_logits_grad)
        self.head_fns = tuple(torch.compile(fn, dynamic=False) for fn in fns) if compile_head else fns

    def forward(self, input_ids: Tensor, position_ids: Tensor, temperatures: Tensor,
                attention_mask: Tensor | None = None, sources: Tensor | None = None) -> TokenLogprobs:
        """input_ids, position_ids ``[T]`` or ``[B, T]`` int64; temperatures the same shape, fp32 (token t's
        sampling temperature). Rows of a ``[B, T]`` batch are independent packed sequences; outputs have the
        input's shape. ``attention_mask`` (``[T, T]`` / ``[B, T, T]`` bool) and ``sources`` (``[T]`` / ``[B, T]``)
        come together, from :func:`packed_layout`, for samples that share prompts."""
        rows = input_ids.dim() == 2
        if not rows:
            input_ids, position_ids, temperatures = input_ids[None], position_ids[None], temperatures[None]
            if sources is not None:
                attention_mask, sources = attention_mask[None], sources[None]
        if sources is None:
            logprobs, entropy = self._next_tokens(input_ids, position_ids, temperatures)
            zero = logprobs.new_zeros(input_ids.shape[0], 1)
            if not rows:  # concatenate the 1-D rows: a fresh tensor, not a view (FSDP hooks the module's outputs)
                return TokenLogprobs(logprobs=torch.cat([zero[0], logprobs[0]]),
                                     entropy=torch.cat([zero[0], entropy[0]]))
            return TokenLogprobs(logprobs=torch.cat([zero, logprobs], dim=1), entropy=torch.cat([zero, entropy], dim=1))
        logprobs, entropy = self._from_sources(input_ids, position_ids, temperatures, attention_mask, sources)
        none = (sources if rows else sources[0]) < 0  # masked_fill: a fresh tensor of the input's shape, as above
        return TokenLogprobs(logprobs=logprobs.view(none.shape).masked_fill(none, 0.0),
                             entropy=entropy.view(none.shape).masked_fill(none, 0.0))

    def _head(self, hidden: Tensor, targets: Tensor, temperatures: Tensor) -> tuple[Tensor, Tensor]:
        """Logprob of each target and entropy, ``[N]`` fp32, from hidden ``[N, H]`` and temperatures ``[N]``."""
        temps = temperatures.float()
        inv_temp = torch.where(temps > 0, 1.0 / temps.clamp_min(1e-6), torch.ones_like(temps))
        keep_bytes = self.keep_bytes if torch.is_grad_enabled() else 0
        return ChunkedLogprobs.apply(hidden, self.lm.get_output_embeddings().weight, targets, inv_temp,
                                     self.chunk_size, self.head_fns, self.entropy_grad, keep_bytes)

    def _next_tokens(self, input_ids: Tensor, position_ids: Tensor, temperatures: Tensor) -> tuple[Tensor, Tensor]:
        """Every sample holds all its tokens: ``[B, T − 1]`` logprobs and entropy of tokens 1.., each predicted from
        the token before it (0 for a sample's first)."""
        out = self.lm.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state[:, :-1].reshape(-1, out.last_hidden_state.shape[-1])
        logprobs, entropy = self._head(hidden, input_ids[:, 1:].reshape(-1), temperatures[:, 1:].reshape(-1))
        first = position_ids[:, 1:] == 0  # first token of a sample: not predicted from this sample
        return logprobs.view(first.shape).masked_fill(first, 0.0), entropy.view(first.shape).masked_fill(first, 0.0)

    def _from_sources(self, input_ids: Tensor, position_ids: Tensor, temperatures: Tensor, attention_mask: Tensor,
                      sources: Tensor) -> tuple[Tensor, Tensor]:
        """``[B × T]`` logprobs and entropy, token t predicted from token ``sources[t]`` of its row (clamped at 0:
        the caller zeroes the tokens whose source is −1)."""
        out = self.lm.base_model(input_ids=input_ids, position_ids=position_ids,
                                 attention_mask=attention_mask[:, None], use_cache=False)
        rows, width = input_ids.shape
        hidden = out.last_hidden_state.reshape(rows * width, -1)
        offsets = torch.arange(rows, device=sources.device)[:, None] * width
        hidden = hidden.index_select(0, (sources.clamp_min(0) + offsets).reshape(-1))
        return self._head(hidden, input_ids.reshape(-1), temperatures.reshape(-1))
