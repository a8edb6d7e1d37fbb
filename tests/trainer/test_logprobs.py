"""Packed and chunked logprobs equal the unpacked, full-logit ones (values and gradients)."""

import pytest
import torch

from tests.trainer.helpers import micro_batch, tiny_lm
from trainer.logprobs import PolicyModel
from trainer.step import to_batch

torch.set_num_threads(1)
CPU = torch.device("cpu")


def test_packed_logprobs_equal_unpacked():
    policy = PolicyModel(tiny_lm(), chunk_size=5)
    mb = micro_batch(1, 0, 1, [(4, 9), (3, 6), (2, 11)], temperature=0.8)
    b = to_batch(mb, CPU, 1)
    with torch.no_grad():
        packed = policy(b.input_ids, b.position_ids, b.temperatures)
        start, pieces, ents = 0, [], []
        for n in mb.sample_lengths.tolist():
            sl = slice(start, start + n)
            one = policy(b.input_ids[sl], b.position_ids[sl], b.temperatures[sl])
            pieces.append(one.logprobs)
            ents.append(one.entropy)
            start += n
    assert torch.allclose(packed.logprobs, torch.cat(pieces), atol=1e-5, rtol=0)
    assert torch.allclose(packed.entropy, torch.cat(ents), atol=1e-5, rtol=0)


KEEP = pytest.mark.parametrize("keep_bytes", [0, 2**30], ids=["recomputed", "kept"])
"""Both backward paths of the head: logits recomputed per chunk, and the forward's softmax kept."""


@KEEP
def test_chunked_logprobs_and_grads_match_full_logits_with_temperature(keep_bytes):
    lm = tiny_lm()
    policy = PolicyModel(lm, chunk_size=3, keep_bytes=keep_bytes)
    ids = torch.randint(0, 300, (17,))
    temps = torch.linspace(0.5, 1.2, 17)  # each token its own temperature
    weights = torch.randn(17)
    out = policy(ids, torch.arange(17), temps)
    (out.logprobs * weights).sum().backward()
    chunked_grads = [p.grad.clone() for p in lm.parameters()]
    lm.zero_grad()
    logp = torch.log_softmax(lm(input_ids=ids[None]).logits[0, :-1].float() / temps[1:, None], -1)
    ref = logp.gather(-1, ids[1:, None])[:, 0]
    (ref * weights[1:]).sum().backward()
    assert torch.allclose(out.logprobs[1:], ref, atol=1e-5)
    assert torch.allclose(out.entropy[1:], -(logp.exp() * logp).sum(-1), atol=1e-5)
    for got, want in zip(chunked_grads, [p.grad for p in lm.parameters()], strict=True):
        assert torch.allclose(got, want, atol=1e-5)


@KEEP
def test_entropy_grads_match_full_logits(keep_bytes):
    lm = tiny_lm()
    policy = PolicyModel(lm, chunk_size=4, entropy_grad=True, keep_bytes=keep_bytes)
    ids = torch.randint(0, 300, (13,))
    temps = torch.full((13,), 0.7)
    a, b = torch.randn(13), torch.randn(13)
    out = policy(ids, torch.arange(13), temps)
    ((out.logprobs * a).sum() + (out.entropy * b).sum()).backward()
    chunked_grads = [p.grad.clone() for p in lm.parameters()]
    lm.zero_grad()
    logp = torch.log_softmax(lm(input_ids=ids[None]).logits[0, :-1].float() / 0.7, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    ((logp.gather(-1, ids[1:, None])[:, 0] * a[1:]).sum() + (entropy * b[1:]).sum()).backward()
    for got, want in zip(chunked_grads, [p.grad for p in lm.parameters()], strict=True):
        assert torch.allclose(got, want, atol=1e-5)
    lm.zero_grad()  # the entropy alone also backpropagates
    policy(ids, torch.arange(13), temps).entropy.sum().backward()
    assert all(p.grad is not None for p in lm.parameters())


def test_bfloat16_head_keeps_the_temperature_in_fp32_and_both_backward_paths_agree():
    ids = torch.randint(0, 300, (23,))
    temps = torch.linspace(0.6, 1.0, 23)
    weights = torch.randn(23)
    full = tiny_lm()
    logp = torch.log_softmax(full(input_ids=ids[None]).logits[0, :-1].float() / temps[1:, None], -1)
    want = logp.gather(-1, ids[1:, None])[:, 0]
    grads = []
    for keep_bytes in (0, 2**30):
        lm = tiny_lm().to(torch.bfloat16)
        out = PolicyModel(lm, chunk_size=5, keep_bytes=keep_bytes)(ids, torch.arange(23), temps)
        assert out.logprobs.dtype == torch.float32
        assert torch.allclose(out.logprobs[1:], want, atol=0.05)
        (out.logprobs * weights).sum().backward()
        grads.append([p.grad.float() for p in lm.parameters()])
    for recomputed, kept in zip(*grads, strict=True):
        assert torch.allclose(recomputed, kept, atol=1e-2, rtol=1e-2)
