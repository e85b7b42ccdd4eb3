"""Packing is exact: packed rows give the per-sequence log-probs and DPO gradients of padded batches.

Tiny random Llama and Qwen2 models (built from configs, fp32) for every backend that
runs on CPU, including ds_packdpo's own ``sdpa_varlen`` (checked against a dense
block-diagonal mask too, values and gradients).  flex_attention runs forward only here: torch 2.13 raises
``NotImplementedError: FlexAttention does not support backward on CPU`` (measured), so
its gradient parity is left to GPU machines.
"""

from __future__ import annotations

import pytest
import torch

from ds_packdpo.model.attention import varlen_attention
from ds_packdpo.model.collate import collate_packed, collate_padded
from ds_packdpo.model.logps import SequenceLogps, forward_logps
from ds_packdpo.model.losses import LossConfig, global_normalized_loss, pair_losses
from ds_packdpo.model.build import build_model
from ds_packdpo.model.guard import assert_packing_exact

VOCAB = 512
LOSSES = [LossConfig("sigmoid", beta=0.5), LossConfig("ipo", beta=0.5), LossConfig("simpo", beta=2.0, rpo_alpha=0.5)]


def random_pairs(count: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)

    def ids(low: int, high: int) -> list[int]:
        return torch.randint(0, VOCAB, (int(torch.randint(low, high, (), generator=g)),), generator=g).tolist()

    return [{"prompt_ids": ids(1, 25), "chosen_ids": ids(1, 30), "rejected_ids": ids(1, 30)} for _ in range(count)]


def both_layouts(pairs):
    index = list(range(len(pairs)))
    return collate_packed(pairs, index, pad_token_id=0), collate_padded(pairs, index, pad_token_id=0)


def dpo_gradients(model, batch, attn, reference, cfg):
    model.zero_grad(set_to_none=True)
    losses, _ = pair_losses(forward_logps(model, batch, attn, chunk_tokens=16), reference, cfg)
    global_normalized_loss(losses, global_pairs=batch.num_pairs, gradient_divisor=1).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("attn", ["sdpa_varlen", "sdpa", "eager"])
@pytest.mark.parametrize("arch", ["tiny", "tiny-qwen2"])
def test_packed_equals_padded_logps_and_dpo_gradients(arch, attn):
    model = build_model(None, arch, VOCAB, torch.float32, attn, seed=0)
    pairs = random_pairs(4, seed=7)
    packed, padded = both_layouts(pairs)
    assert packed.computed_tokens < padded.computed_tokens  # the rows really differ in layout

    policy_packed = forward_logps(model, packed, attn)
    policy_padded = forward_logps(model, padded, attn)
    assert (policy_packed.logps - policy_padded.logps).abs().max() <= 1e-4
    assert torch.equal(policy_packed.tokens, policy_padded.tokens)
    torch.testing.assert_close(policy_packed.logits_sum, policy_padded.logits_sum, rtol=1e-5, atol=1e-5)
    expected_tokens = [float(len(p[k])) for p in pairs for k in ("chosen_ids", "rejected_ids")]
    assert policy_packed.tokens.tolist() == expected_tokens

    with torch.no_grad():  # a reference from another model, given as precomputed values
        reference_model = build_model(None, arch, VOCAB, torch.float32, attn, seed=1)
        ref = forward_logps(reference_model, packed, attn)
        reference = SequenceLogps(ref.logps.clone(), ref.tokens, ref.logits_sum)

    for cfg in LOSSES:
        grads_packed = dpo_gradients(model, packed, attn, reference, cfg)
        grads_padded = dpo_gradients(model, padded, attn, reference, cfg)
        for name, grad in grads_padded.items():
            difference = (grads_packed[name] - grad).norm()
            assert difference <= 1e-4 * grad.norm() + 1e-9, (cfg.loss_type, name, float(difference), float(grad.norm()))
        assert sum(float(g.norm()) for g in grads_padded.values()) > 1e-3


@pytest.mark.parametrize("arch", ["tiny", "tiny-qwen2"])
def test_flex_attention_packed_equals_padded_forward(arch):
    model = build_model(None, arch, VOCAB, torch.float32, "flex_attention", seed=0).eval()
    packed, padded = both_layouts(random_pairs(3, seed=11))
    with torch.no_grad():
        difference = (forward_logps(model, packed, "flex_attention").logps
                      - forward_logps(model, padded, "flex_attention").logps).abs().max()
    assert difference <= 1e-4


def test_dummy_row_contributes_zero_loss_and_zero_gradient():
    """A rank with no pair left still runs one forward/backward (ZeRO-3 needs it), adding nothing."""
    model = build_model(None, "tiny", VOCAB, torch.float32, "sdpa", seed=0)
    dummy = collate_packed([], [], pad_token_id=0)
    policy = forward_logps(model, dummy, "sdpa")
    losses, metrics = pair_losses(policy, policy, LossConfig())
    loss = global_normalized_loss(losses, global_pairs=8, gradient_divisor=2)
    loss.backward()
    assert policy.logps.shape == (0,) and float(loss.detach()) == 0.0 and metrics["rewards/chosen"].shape == (0,)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def block_diagonal_reference(q, k, v, lengths):
    """Dense causal attention with a block-diagonal mask over the whole row: [T, H, D] in and out."""
    total = sum(lengths)
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    mask = causal & (segment[:, None] == segment[None, :])
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           attn_mask=mask)
    return out.transpose(0, 1)


def test_varlen_attention_equals_block_diagonal_mask_values_and_gradients():
    lengths = [5, 1, 17, 9, 30]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lengths), 8, 16, generator=g, requires_grad=True)
    k = torch.randn(sum(lengths), 2, 16, generator=g, requires_grad=True)  # grouped-query: 4 query heads per KV head
    v = torch.randn(sum(lengths), 2, 16, generator=g, requires_grad=True)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu_seqlens)
    expected = block_diagonal_reference(q, k, v, lengths)
    assert out.shape == q.shape and (out - expected).abs().max() <= 1e-6
    grad_out = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    for grad, reference in zip(grads, expected_grads):
        assert (grad - reference).abs().max() <= 1e-5 * reference.abs().max()
    with pytest.raises(ValueError, match="cu_seqlens"):
        varlen_attention(q, k, v, [0, 3])


@pytest.mark.parametrize("arch", ["tiny", "tiny-qwen2"])
def test_sdpa_varlen_equals_dense_mask_sdpa_on_packed_rows(arch):
    """Same weights, same packed row: the per-sequence kernel vs transformers' dense block-diagonal mask."""
    pairs = random_pairs(5, seed=5)
    packed, _ = both_layouts(pairs)
    grads, logps = {}, {}
    for attn in ("sdpa_varlen", "sdpa"):
        model = build_model(None, arch, VOCAB, torch.float32, attn, seed=0)
        out = forward_logps(model, packed, attn)
        out.logps.sum().backward()
        logps[attn] = out.logps.detach()
        grads[attn] = {name: p.grad for name, p in model.named_parameters()}
    assert (logps["sdpa_varlen"] - logps["sdpa"]).abs().max() <= 2e-5  # sums of ~50 token log-probs of ~6.2
    for name, grad in grads["sdpa"].items():
        assert (grads["sdpa_varlen"][name] - grad).norm() <= 1e-5 * grad.norm() + 1e-9, name
    model = build_model(None, arch, VOCAB, torch.float32, "sdpa_varlen", seed=0)
    assert assert_packing_exact(model, "sdpa_varlen", VOCAB, pad_token_id=0)["max_abs_diff_logps"] <= 1e-5
