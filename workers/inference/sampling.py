"""Per-row sampling for a batch of sequences: temperature, top-k, top-p, min-p, per-request seeds.

Logprobs are ``log_softmax(logits / temperature)`` of the sampled token: the full distribution at the
temperature, the one the trainer computes (top-k/top-p/min-p only restrict what can be drawn).
Greedy rows (temperature 0) take the argmax and report ``log_softmax(logits)``.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples (vLLM's field names and defaults)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = None
    """None: up to the model's context limit."""
    min_tokens: int = 0
    """Stop tokens are ignored before this many tokens."""
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    """None: no logprobs in the response; k ≥ 0: the sampled token's logprob plus the top k."""
    prompt_logprobs: int | None = None
    """None: none; k ≥ 0: the logprob of each prompt token (plus the top k)."""

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


@dataclass
class RowParams:
    """The sampling parameters of every row of the batch, as tensors (rebuilt when rows change)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    generators: list[torch.Generator | None]
    any_filtered: bool
    any_greedy: bool

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None]) -> "RowParams":
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        return cls(
            temperature=temps,
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32),
            generators=generators,
            any_filtered=any(p.filtered for p in params),
            any_greedy=bool((temps == 0).any()),
        )


def sample(logits: torch.Tensor, rows: RowParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits`` [B, V].

    Returns (tokens [B] long, logprobs of the drawn tokens [B], full logprobs [B, V]).
    """
    logits = logits.float()
    temps = rows.temperature.to(logits.device)
    greedy = temps == 0
    scale = torch.where(greedy, torch.ones_like(temps), temps)
    logprobs = torch.log_softmax(logits / scale[:, None], dim=-1)
    candidates = _restrict(logprobs, rows) if rows.any_filtered else logprobs
    # Exponential race (Gumbel-max): argmax(log p - log E), E ~ Exp(1), draws from p.
    noise = _exponential(candidates.shape, candidates.device)
    for i, generator in enumerate(rows.generators):
        if generator is not None:
            noise[i] = _exponential((noise.shape[1],), torch.device("cpu"), generator).to(noise.device)
    tokens = torch.argmax(candidates - noise.log(), dim=-1)
    if rows.any_greedy:
        tokens = torch.where(greedy.to(tokens.device), torch.argmax(logits, dim=-1), tokens)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return tokens, chosen, logprobs


def _exponential(shape: tuple[int, ...], device: torch.device,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Exp(1) draws as ``-log(1 - U)``: a third of ``Tensor.exponential_``'s time on the CPU; kept above the
    smallest normal float, so that ``log`` of one is finite (a token restricted to -inf stays out of the race)."""
    uniform = torch.rand(shape, device=device, generator=generator)
    return uniform.neg_().log1p_().neg_().clamp_min_(torch.finfo(uniform.dtype).tiny)


def _restrict(logprobs: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """``logprobs`` with the tokens outside each row's top-k / top-p / min-p set to -inf."""
    device = logprobs.device
    sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
    vocab = logprobs.shape[-1]
    ranks = torch.arange(vocab, device=device)[None, :]
    top_k = rows.top_k.to(device)
    drop = (top_k[:, None] > 0) & (ranks >= top_k[:, None])
    probs = sorted_lp.exp()
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly above each token
    drop |= before >= rows.top_p.to(device)[:, None]
    drop |= probs < rows.min_p.to(device)[:, None] * probs[:, :1]
    drop[:, 0] = False  # the most likely token always stays
    sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
    return torch.empty_like(logprobs).scatter_(1, order, sorted_lp)
