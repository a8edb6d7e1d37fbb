"""Token logprobs and entropy of packed samples, computed in chunks over the sequence.

The head's ``[tokens, vocab]`` fp32 logits are never materialised: :class:`ChunkedLogprobs`
computes ``chunk_size`` rows at a time in the forward pass and recomputes them in the backward
pass, so logits memory is ``chunk_size × vocab`` whatever the sequence length (the 150k-vocab
case on GPU). Logits are divided by each token's sampling temperature before the softmax.

Packed samples never attend across their boundaries: position ids restart at 0 per sample and
transformers (SDPA attention, no 2-D attention mask) turns that into a block-diagonal causal mask;
``tests/trainer/test_logprobs.py`` checks packed == unpacked logprobs.
"""

from dataclasses import dataclass

import torch
from torch import Tensor, nn


def chunk_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk's ``(logprob of target, entropy)``, both ``[n]`` fp32, from hidden ``[n, H]``."""
    logits = (hidden @ weight.t()).float() * inv_temp[:, None]
    lse = logits.logsumexp(-1)
    target = logits.gather(-1, targets[:, None])[:, 0]
    probs = (logits - lse[:, None]).exp()
    return target - lse, lse - (probs * logits).sum(-1)


def chunk_logits_grad(hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: Tensor, grad_out: Tensor,
                      grad_entropy: Tensor | None = None) -> Tensor:
    """d(Σ grad_out · logprob + Σ grad_entropy · entropy) / d(hidden Wᵀ) of one chunk, ``[n, V]`` in the weight's
    dtype.

    ``d logp[target] / d logits = onehot(target) − p`` and ``d H / d logits = −p · (log p + H)``, times the
    incoming gradients and 1/τ.
    """
    logits = (hidden @ weight.t()).float() * inv_temp[:, None]
    logp = logits.log_softmax(-1) if grad_entropy is not None else None
    probs = logits.softmax(-1) if logp is None else logp.exp()
    columns = torch.arange(probs.shape[-1], device=probs.device)
    grad = torch.where(columns[None, :] == targets[:, None], 1.0 - probs, -probs)
    if logp is None:
        return (grad * (grad_out * inv_temp)[:, None]).to(weight.dtype)
    entropy = -(probs * logp).sum(-1)
    grad = grad * grad_out[:, None] - probs * (logp + entropy[:, None]) * grad_entropy[:, None]
    return (grad * inv_temp[:, None]).to(weight.dtype)


class ChunkedLogprobs(torch.autograd.Function):
    """``log softmax(h Wᵀ / τ)[target]`` and the entropy of that distribution, chunk by chunk.

    Shapes: hidden ``[T, H]``, weight ``[V, H]``, targets ``[T]`` (int64), inv_temp ``[T]`` (fp32)
    → logprobs ``[T]`` fp32 (differentiable) and entropy ``[T]`` fp32, differentiable only with ``entropy_grad``
    (``trainer.entropy_coef``; otherwise a metric, and its backward does no extra work).
    ``fns`` is ``(chunk_logprobs, chunk_logits_grad)`` or torch.compiled versions of them (one
    fused kernel per chunk instead of a dozen passes over ``[chunk, V]`` fp32).
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: Tensor, chunk_size: int, fns,
                entropy_grad: bool = False):
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            logprobs[start:end], entropy[start:end] = fns[0](hidden[start:end], weight, targets[start:end],
                                                               inv_temp[start:end])
        ctx.save_for_backward(hidden, weight, targets, inv_temp)
        ctx.chunk_size, ctx.fns, ctx.entropy_grad = chunk_size, fns, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor, grad_entropy: Tensor):
        hidden, weight, targets, inv_temp = ctx.saved_tensors
        if not ctx.entropy_grad:
            grad_entropy = None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            h = hidden[start:end]
            grad = ctx.fns[1](h, weight, targets[start:end], inv_temp[start:end], grad_logprobs[start:end],
                              None if grad_entropy is None else grad_entropy[start:end])
            if grad_hidden is not None:
                grad_hidden[start:end] = grad @ weight
            if grad_weight is not None:
                grad_weight += (grad.t() @ h).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


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

    def __init__(self, lm: nn.Module, chunk_size: int = 1024, compile_head: bool = False, entropy_grad: bool = False):
        super().__init__()
        head = lm.get_output_embeddings()
        if not isinstance(head, nn.Linear) or head.bias is not None:
            raise ValueError(f"{type(lm).__name__}: output head {type(head).__name__} is not a bias-free Linear")
        self.lm = lm
        self.chunk_size = chunk_size
        self.entropy_grad = entropy_grad
        """Whether the entropy is differentiable (a loss uses it: ``trainer.entropy_coef``)."""
        fns = (chunk_logprobs, chunk_logits_grad)
        self.head_fns = tuple(torch.compile(fn, dynamic=False) for fn in fns) if compile_head else fns

    def forward(self, input_ids: Tensor, position_ids: Tensor, temperatures: Tensor) -> TokenLogprobs:
        """input_ids, position_ids ``[T]`` or ``[B, T]`` int64; temperatures the same shape, fp32 (token t's
        sampling temperature). Rows of a ``[B, T]`` batch are independent packed sequences; outputs have the
        input's shape."""
        rows = input_ids.dim() == 2
        if not rows:
            input_ids, position_ids, temperatures = input_ids[None], position_ids[None], temperatures[None]
        out = self.lm.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state[:, :-1].reshape(-1, out.last_hidden_state.shape[-1])
        temps = temperatures[:, 1:].float().reshape(-1)
        inv_temp = torch.where(temps > 0, 1.0 / temps.clamp_min(1e-6), torch.ones_like(temps))
        weight = self.lm.get_output_embeddings().weight
        targets = input_ids[:, 1:].reshape(-1)
        logprobs, entropy = ChunkedLogprobs.apply(hidden, weight, targets, inv_temp, self.chunk_size, self.head_fns,
                                                  self.entropy_grad)
        first = position_ids[:, 1:] == 0  # first token of a sample: not predicted from this sample
        logprobs = logprobs.view(first.shape).masked_fill(first, 0.0)
        entropy = entropy.view(first.shape).masked_fill(first, 0.0)
        zero = logprobs.new_zeros(input_ids.shape[0], 1)
        if not rows:  # concatenate the 1-D rows: a fresh tensor, not a view (FSDP hooks the module's outputs)
            return TokenLogprobs(logprobs=torch.cat([zero[0], logprobs[0]]), entropy=torch.cat([zero[0], entropy[0]]))
        return TokenLogprobs(logprobs=torch.cat([zero, logprobs], dim=1), entropy=torch.cat([zero, entropy], dim=1))
