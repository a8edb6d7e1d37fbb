"""Sampling: logprobs of the full distribution at the temperature, top-p/min-p, seeded rows."""

import torch

from workers.inference.sampling import RowParams, SamplingParams, sample


def _rows(*params: SamplingParams, seeds=None) -> RowParams:
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in (seeds or [None] * len(params))]
    return RowParams.build(list(params), gens)


def test_sampled_logprobs_are_the_full_distribution_at_the_temperature():
    logits = torch.randn(3, 50)
    tokens, chosen, full = sample(logits, _rows(SamplingParams(temperature=0.5), SamplingParams(top_k=3),
                                                SamplingParams(temperature=0.0)))
    expected = torch.log_softmax(logits / torch.tensor([0.5, 1.0, 1.0])[:, None], -1)
    assert torch.allclose(full, expected)
    assert torch.allclose(chosen, expected.gather(1, tokens[:, None]).squeeze(1))
    assert tokens[1] in logits[1].topk(3).indices and tokens[2] == logits[2].argmax()


def test_top_p_and_min_p_restrict_the_draws():
    logits = torch.tensor([[4.0, 3.9, 0.0, -1.0, -2.0]] * 200)
    tokens, _, _ = sample(logits, _rows(*[SamplingParams(top_p=0.5)] * 100, *[SamplingParams(min_p=0.5)] * 100))
    assert set(tokens[:100].tolist()) <= {0, 1} and set(tokens[100:].tolist()) <= {0, 1}


def test_seeded_rows_repeat_and_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    draws = [sample(logits, _rows(SamplingParams(), seeds=[s]))[0].item() for s in range(2000)]
    assert abs(draws.count(0) / 2000 - 0.7) < 0.05
    again = [sample(logits, _rows(SamplingParams(), seeds=[s]))[0].item() for s in range(50)]
    assert again == draws[:50]


def test_a_batch_of_rows_draws_from_the_distribution_and_never_a_restricted_token():
    logits = torch.log(torch.tensor([[0.6, 0.25, 0.1, 0.05]] * 4000))
    tokens, _, _ = sample(logits, _rows(*[SamplingParams()] * 2000, *[SamplingParams(top_k=2)] * 2000))
    free = torch.bincount(tokens[:2000], minlength=4) / 2000
    assert torch.allclose(free, torch.tensor([0.6, 0.25, 0.1, 0.05]), atol=0.035)
    assert set(tokens[2000:].tolist()) == {0, 1}
    assert abs((tokens[2000:] == 0).float().mean().item() - 0.6 / 0.85) < 0.035
