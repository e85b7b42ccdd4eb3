"""Prefix sharing is exact: a pair laid out as [prompt | chosen | rejected] gives the log-probs and DPO gradients of
its two sequences run apart.

The kernel is checked against an independent dense fp64 attention built from the definition (values and
gradients, grouped-query heads, sliding windows, soft-capping), the flash-attn kernel's index work against an
emulation of flash's documented varlen semantics (no CUDA here), and whole models (tiny Llama, Qwen2 and a
sliding-window Mistral, fp32) against the unshared packed row and against each sequence alone with eager
attention; tests/test_architectures.py checks every architecture of the matrix the same way.
Under sequence parallelism (S = 2) the shared row is checked in tests/test_sequence_parallel.py's launch, the
trajectory in tests/test_trainer_multirank.py's.
"""

from __future__ import annotations

import pytest
import torch

from ds_packdpo.config import parse_train_args
from ds_packdpo.errors import InputError, PackingNotExactError
from ds_packdpo.model import prefix_attention
from ds_packdpo.model.build import build_model
from ds_packdpo.model.collate import PrefixLayout, collate_packed, collate_padded, collate_shared
from ds_packdpo.model.guard import assert_packing_exact, packing_exactness
from ds_packdpo.model.logps import forward_logps
from ds_packdpo.model.losses import LossConfig, global_normalized_loss, pair_losses
from ds_packdpo.model.prefix_attention import flash_segments, flash_shared_prefix, shared_prefix_attention
from ds_packdpo.run.assemble import prepare

from varlen_emulation import emulated_flash_varlen

VOCAB = 512
# pair blocks (P, C, R): an empty chosen, an empty rejected, a 1-token (cut) prompt, and a padding-like block
LAYOUT = PrefixLayout(((5, 3, 4), (1, 0, 6), (7, 4, 0), (1, 9, 2), (6, 0, 0), (3, 5, 5)))


def dense_reference(q, k, v, layout: PrefixLayout, window=None, softcap=None):
    """fp64 attention of the whole row with the mask written from the definition: same pair, key position <= query
    position, and a completion token sees the prompt and its own side only."""
    position, block, side = [], [], []
    for g, (p, c, r) in enumerate(layout.blocks):
        position += [*range(p), *range(p, p + c), *range(p, p + r)]
        block += [g] * (p + c + r)
        side += [0] * p + [1] * c + [2] * r
    position, block, side = map(torch.tensor, (position, block, side))
    visible = ((block[:, None] == block[None]) & (position[None] <= position[:, None])
               & ((side[None] == 0) | (side[None] == side[:, None])))
    if window:
        visible &= position[:, None] - position[None] < window
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1).double(), v.repeat_interleave(groups, 1).double()
    scores = torch.einsum("thd,shd->hts", q.double(), k) / q.shape[-1] ** 0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.einsum("hts,shd->thd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


def random_qkv(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, heads, 16, generator=g, requires_grad=True) for heads in (8, 2, 2)]


@pytest.mark.parametrize("window, softcap", [(None, None), (4, None), (None, 3.0), (3, 2.0), (100, None)])
def test_kernel_equals_dense_definition_values_and_gradients(window, softcap):
    q, k, v = random_qkv(LAYOUT.tokens, seed=1)
    out = shared_prefix_attention(q, k, v, LAYOUT, sliding_window=window, softcap=softcap)
    expected = dense_reference(q, k, v, LAYOUT, window, softcap)
    assert out.shape == q.shape and (out - expected).abs().max() <= 1e-6
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out.double())
    for grad, reference in zip(grads, expected_grads):
        assert (grad - reference).abs().max() <= 1e-5 * reference.abs().max()
    with pytest.raises(ValueError, match="covers 61 tokens, the row has 50"):
        shared_prefix_attention(q[:50], k[:50], v[:50], LAYOUT)


@pytest.mark.parametrize("window, softcap", [(None, None), (4, 2.0)])
def test_flash_kernel_gathers_the_prompt_for_every_rejected_block(monkeypatch, window, softcap):
    """The one varlen call (its cu_seqlens and prompt gather) run through an emulation of flash-attn's varlen kernel."""
    monkeypatch.setattr(prefix_attention, "flash_attn_supports_top_left_mask", lambda: False)
    monkeypatch.setattr(prefix_attention, "lazy_import_flash_attention",
                        lambda attn: ((None, emulated_flash_varlen), None))
    q, k, v = random_qkv(LAYOUT.tokens, seed=3)
    attend = flash_shared_prefix("flash_attention_2")
    out = attend(q, k, v, LAYOUT, scale=0.25, sliding_window=window, softcap=softcap)
    expected = shared_prefix_attention(q, k, v, LAYOUT, scale=0.25, sliding_window=window, softcap=softcap)
    assert (out - expected).abs().max() <= 1e-5
    cu_q, cu_k, index, max_q, max_k = flash_segments(LAYOUT, torch.device("cpu"))
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q[-1] == LAYOUT.tokens and (max_q, max_k) == (11, 11)
    prompt_keys = sum(p for p, _, r in LAYOUT.blocks if r)  # every prompt once more, for its rejected block
    assert cu_k[-1] == index.numel() == LAYOUT.tokens + prompt_keys
    assert cu_k.tolist()[:4] == [0, 8, 17, 18] and index[8:17].tolist() == [*range(5), *range(8, 12)]
    monkeypatch.setattr(prefix_attention, "flash_attn_supports_top_left_mask", lambda: True)
    with pytest.raises(InputError, match="aligns causal masks top-left .* --no-prefix-sharing"):
        flash_shared_prefix("flash_attention_2")


def random_pairs(count: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)

    def ids(low: int, high: int) -> list[int]:
        return torch.randint(0, VOCAB, (int(torch.randint(low, high, (), generator=g)),), generator=g).tolist()

    pairs = [{"prompt_ids": ids(1, 25), "chosen_ids": ids(1, 30), "rejected_ids": ids(1, 30)} for _ in range(count)]
    pairs[1]["chosen_ids"] = []  # an empty completion
    pairs[2]["prompt_ids"] = pairs[2]["prompt_ids"][-1:]  # a prompt cut to its last token
    return pairs


def model_for(arch: str, attn: str):
    return build_model(None, arch, VOCAB, torch.float32, attn, seed=0)


def dpo_logps_and_gradients(model, batch, attn: str, impl: str):
    """Per-sequence log-probs and the gradients of a DPO loss against a fixed reference."""
    policy = forward_logps(model, batch, attn, chunk_tokens=16, impl=impl)
    reference = policy.logps.detach() * 1.1
    losses, _ = pair_losses(policy, type(policy)(reference, policy.tokens, policy.logits_sum), LossConfig(beta=0.5))
    global_normalized_loss(losses, global_pairs=batch.num_pairs, gradient_divisor=1).backward()
    return policy, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["tiny", "tiny-qwen2", "tiny-mistral"])
def test_shared_rows_equal_unshared_logps_and_gradients(arch):
    """fp32: the shared row against the unshared packed row (the same kernels: Llama, Qwen2) or against the padded
    batch under eager attention (every sequence alone with transformers' own sliding-window mask: Mistral, every
    layer a window of 8 tokens; tests/test_architectures.py checks every architecture of the matrix the same way)."""
    pairs = random_pairs(5, seed=7)
    index = list(range(len(pairs)))
    shared = collate_shared(pairs, index, 0)
    assert shared.computed_tokens < collate_packed(pairs, index, 0).computed_tokens
    windowed = arch == "tiny-mistral"
    reference_attn, reference_batch = (("eager", collate_padded(pairs, index, 0)) if windowed
                                       else ("sdpa_varlen", collate_packed(pairs, index, 0)))
    for impl in ("lean", "plain"):
        got, got_grads = dpo_logps_and_gradients(model_for(arch, "sdpa_varlen"), shared, "sdpa_varlen", impl)
        want, want_grads = dpo_logps_and_gradients(model_for(arch, reference_attn), reference_batch, reference_attn,
                                                   impl)
        # sums of ~20 token log-probs of ~6.2: 1e-6 relative is a few fp32 roundings of the result
        assert ((got.logps - want.logps).abs() <= 1e-6 * want.logps.abs().clamp_min(1)).all(), (impl, got.logps - want.logps)
        assert torch.equal(got.tokens, want.tokens) and got.tokens[2] == 0  # the empty chosen completion scores none
        assert (got.logits_sum - want.logits_sum).abs().max() <= 1e-5
        for name, grad in want_grads.items():
            assert (got_grads[name] - grad).norm() <= 1e-5 * grad.norm() + 1e-9, (impl, name)
    if windowed:  # the window matters here: without it the log-probs differ
        unwindowed = model_for(arch, "sdpa_varlen")
        unwindowed.config.sliding_window = None
        with torch.no_grad():
            assert (forward_logps(unwindowed, shared, "sdpa_varlen").logps - want.logps).abs().max() > 1e-3


def test_guard_checks_the_shared_layout_and_refuses_a_backend_that_ignores_it():
    model = build_model(None, "tiny", VOCAB, torch.float32, "sdpa_varlen", seed=0)
    result = assert_packing_exact(model, "sdpa_varlen", VOCAB, pad_token_id=0, shared_prefix=True)
    assert result["layout"] == "shared-prefix" and result["max_abs_diff_logps"] <= 1e-5
    # transformers' sdpa derives its mask from position ids: the rejected block would not see its prompt
    sdpa = build_model(None, "tiny", VOCAB, torch.float32, "sdpa", seed=0)
    assert not packing_exactness(sdpa, random_pairs(3, seed=1), "sdpa", 0, shared_prefix=True)["ok"]
    with pytest.raises(PackingNotExactError, match="prefix-shared rows are not exact .* use --no-prefix-sharing$"):
        assert_packing_exact(sdpa, "sdpa", VOCAB, pad_token_id=0, shared_prefix=True)


def test_phase_one_shares_prefixes_where_the_backend_can(tmp_path, capsys):
    def setup(*flags):
        return prepare(parse_train_args(["--synthetic-pairs", "16", "--max-length", "64", "--output-dir",
                                         str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), *flags]),
                       "train", world_size=1)

    default = setup()
    assert default.spec.row_layout.shares_prefixes and default.spec.plan.config.layout.shares_prefixes
    assert default.spec.attention.model_attn == "sdpa_varlen"
    assert not setup("--no-prefix-sharing").spec.plan.config.layout.shares_prefixes
    assert not setup("--no-packing").spec.row_layout.shares_prefixes  # padded batches hold whole sequences
    assert not setup("--attn", "sdpa", "--no-prefix-sharing").spec.row_layout.shares_prefixes
    capsys.readouterr()
    # a written --attn that cannot share prefixes turns the default off, in one warning line
    chosen = setup("--attn", "sdpa")
    assert not chosen.spec.row_layout.shares_prefixes and not chosen.spec.plan.config.layout.shares_prefixes
    assert chosen.spec.attention.model_attn == "sdpa"
    sharing_lines = [line for line in capsys.readouterr().err.splitlines() if "prefix sharing" in line]
    assert sharing_lines == ["warning: --attn sdpa: prefix sharing off (sdpa derives its masks from position ids, "
                             "which cannot say [prompt | chosen | rejected]); every prompt runs twice"]
    with pytest.raises(InputError, match=r"^--attn sdpa: prefix sharing .* add --no-prefix-sharing to run sdpa$"):
        setup("--attn", "sdpa", "--prefix-sharing")  # written both: refused


def test_prefix_flash_backend_runs_shared_rows_through_the_flash_call(monkeypatch):
    """A model built with ``PREFIX_FLASH['flash_attention_2']`` gets the shared row's layout and makes the one varlen
    call (emulated here) per layer: the same log-probs as sdpa_varlen's CPU kernel."""
    monkeypatch.setattr(prefix_attention, "flash_attn_supports_top_left_mask", lambda: False)
    monkeypatch.setattr(prefix_attention, "lazy_import_flash_attention",
                        lambda attn: ((None, emulated_flash_varlen), None))
    shared = collate_shared(random_pairs(3, seed=4), [0, 1, 2], 0)
    name = prefix_attention.PREFIX_FLASH["flash_attention_2"]
    with torch.no_grad():
        got = forward_logps(build_model(None, "tiny", VOCAB, torch.float32, name, seed=0), shared, name)
        want = forward_logps(build_model(None, "tiny", VOCAB, torch.float32, "sdpa_varlen", seed=0), shared,
                             "sdpa_varlen")
    assert (got.logps - want.logps).abs().max() <= 1e-6 * want.logps.abs().max()
