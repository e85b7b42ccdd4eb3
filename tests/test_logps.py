"""Chunked label log-probs against a plain log_softmax reference: values, gradients, memory shape."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_packdpo.model.logps import sequence_logps


def random_layout(g: torch.Generator, rows: int, length: int, vocab: int, sequences: int):
    """Arbitrary labels (about half -100) and sequence ids, as a packed or padded collation could give."""
    labels = torch.randint(0, vocab, (rows, length), generator=g)
    labels[torch.rand(rows, length, generator=g) < 0.5] = -100
    seq_index = torch.randint(0, sequences, (rows, length), generator=g)
    return labels, seq_index


def plain_reference(logits, labels, seq_index, sequences):
    """The obvious computation: full fp32 log_softmax, then a loop over sequences summing in fp64."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    mask = labels != -100
    per_token = logp.gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1).double()
    mean_logit = logits.float().mean(-1).double()
    out = [(per_token[mask & (seq_index == s)].sum(), (mask & (seq_index == s)).sum().double(),
            mean_logit[mask & (seq_index == s)].sum()) for s in range(sequences)]
    return [torch.stack(column) for column in zip(*out)]


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 3), length=st.integers(1, 20), vocab=st.integers(2, 50), sequences=st.integers(1, 6),
       chunk=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_chunked_values_and_gradients_match_plain_log_softmax(rows, length, vocab, sequences, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, length, vocab, generator=g) * 4).requires_grad_()
    labels, seq_index = random_layout(g, rows, length, vocab, sequences)
    weights = torch.randn(sequences, generator=g)

    result = sequence_logps(logits, labels, seq_index, sequences, chunk_tokens=chunk)
    (grad,) = torch.autograd.grad((result.logps * weights).sum(), logits)
    ref_logps, ref_tokens, ref_logits_sum = plain_reference(logits, labels, seq_index, sequences)
    (ref_grad,) = torch.autograd.grad((ref_logps * weights).sum(), logits)

    torch.testing.assert_close(result.logps, ref_logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result.tokens, ref_tokens, rtol=0, atol=0)
    torch.testing.assert_close(result.logits_sum, ref_logits_sum.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert {result.logps.dtype, result.tokens.dtype, result.logits_sum.dtype} == {torch.float64}
    assert not result.logits_sum.requires_grad


def test_chosen_rejected_views_follow_canonical_order():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 10, 8, generator=g)
    labels = torch.randint(0, 8, (1, 10), generator=g)
    seq_index = torch.tensor([[0, 0, 1, 1, 1, 2, 3, 3, 3, 3]])
    result = sequence_logps(logits, labels, seq_index, 4)
    assert result.chosen_tokens.tolist() == [2.0, 1.0] and result.rejected_tokens.tolist() == [3.0, 4.0]
    assert torch.equal(result.chosen_logps, result.logps[[0, 2]])
    assert torch.equal(result.rejected_logps, result.logps[[1, 3]])
    assert torch.equal(result.rejected_logits_sum, result.logits_sum[[1, 3]])


def test_bf16_logits_never_saved_as_full_fp32_log_softmax():
    """With bf16 logits, autograd keeps the bf16 logits and per-token scalars, no fp32 [T, V] tensor."""
    g = torch.Generator().manual_seed(1)
    tokens, vocab, chunk = 64, 300, 16
    logits = (torch.randn(1, tokens, vocab, generator=g) * 3).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    labels[0, :5] = -100
    seq_index = (torch.arange(tokens) // 16)[None]
    saved = []

    def pack(tensor):
        saved.append((tensor.dtype, tensor.numel()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = sequence_logps(logits, labels, seq_index, 4, chunk_tokens=chunk)
    largest_fp32 = max(n for dtype, n in saved if dtype == torch.float32)
    assert largest_fp32 < tokens * 2  # per-token logsumexp, not [T, V]
    assert (torch.bfloat16, tokens * vocab) in saved  # the logits themselves

    result.logps.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref = torch.log_softmax(logits.detach().float(), -1).gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1)
    ref_sums = torch.zeros(4, dtype=torch.float64).index_add_(0, seq_index[0][labels[0] != -100],
                                                              ref[0][labels[0] != -100].double())
    torch.testing.assert_close(result.logps.detach(), ref_sums, rtol=1e-5, atol=1e-4)


def test_no_completion_tokens_gives_zeros_and_bad_chunk_is_refused():
    logits = torch.randn(1, 1, 5, requires_grad=True)
    result = sequence_logps(logits, torch.full((1, 1), -100), torch.zeros(1, 1, dtype=torch.long), 0)
    assert result.logps.shape == (0,)
    empty = sequence_logps(logits, torch.full((1, 1), -100), torch.zeros(1, 1, dtype=torch.long), 2)
    assert empty.logps.tolist() == [0.0, 0.0] and empty.tokens.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="chunk_tokens"):
        sequence_logps(logits, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), 1,
                       chunk_tokens=0)


# ----------------------------------------------------------------------------- lean (no [T, V] logits)
def _grads(module: torch.nn.Module, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.grad.clone() for t in tensors] + [p.grad.clone() for p in module.parameters()]


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 3), length=st.integers(1, 16), vocab=st.integers(2, 40), hidden=st.integers(1, 12),
       sequences=st.integers(1, 5), chunk=st.integers(1, 9), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_lean_values_and_gradients_match_plain(rows, length, vocab, hidden, sequences, chunk, bias, seed):
    """lm_head + chunked label log-probs on full logits vs the lean function on hidden states: values and
    gradients (hidden states, lm_head weight and bias) agree to 1e-5."""
    from ds_packdpo.model.logps import lean_token_logps

    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=bias)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    states = torch.randn(rows, length, hidden, generator=g)
    labels, seq_index = random_layout(g, rows, length, vocab, sequences)
    weights = torch.randn(sequences, generator=g)

    plain_states = states.clone().requires_grad_()
    plain = sequence_logps(head(plain_states), labels, seq_index, sequences, chunk_tokens=chunk)
    (plain.logps * weights).sum().backward()
    plain_grads = _grads(head, plain_states)
    head.zero_grad()

    lean_states = states.clone().requires_grad_()
    rows_idx, token_logps, mean_logit = lean_token_logps(lean_states, labels, head, chunk_tokens=chunk)
    seq = seq_index.reshape(-1)[rows_idx]
    per_sequence = torch.zeros(sequences, dtype=torch.float64)
    lean = per_sequence.index_add(0, seq, token_logps.double())
    (lean * weights).sum().backward()
    lean_grads = _grads(head, lean_states)

    torch.testing.assert_close(lean.detach(), plain.logps.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(per_sequence.index_add(0, seq, mean_logit.double()), plain.logits_sum,
                               rtol=1e-5, atol=1e-5)
    for got, want in zip(lean_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch, tied", [("llama", False), ("llama", True), ("qwen2", True), ("gemma2", True),
                                        ("gemma3", False)])
def test_lean_forward_matches_plain_on_a_model(arch, tied):
    """forward_logps on a real HF model, packed and padded: lean = plain in values, logits metric and every
    parameter's gradient (tied embeddings too; Gemma's final logit soft-cap applied inside the chunk loop), and
    lean never saves a [T, V] tensor for backward."""
    from transformers import AutoModelForCausalLM

    from ds_packdpo.model.collate import collate_packed, collate_padded
    from ds_packdpo.model.logps import forward_logps
    from ds_packdpo.model.attention import attn_implementation
    from ds_packdpo.model.build import tiny_config
    from ds_packdpo.model.guard import synthetic_pairs

    vocab = 300
    torch.manual_seed(0)
    attn = "sdpa_varlen" if arch.startswith("gemma") else "sdpa"  # transformers' sdpa lacks Gemma 2's attention cap
    model = AutoModelForCausalLM.from_config(tiny_config(arch, vocab_size=vocab, tie_word_embeddings=tied),
                                             attn_implementation=attn_implementation(attn))
    pairs = synthetic_pairs(3, vocab, seed=1)
    weights = torch.randn(6, generator=torch.Generator().manual_seed(2))
    for collate in (collate_packed, collate_padded):
        batch = collate(pairs, [0, 1, 2], 0)
        results = {}
        for impl in ("plain", "lean"):
            model.zero_grad()
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
                out = forward_logps(model, batch, attn, chunk_tokens=7, impl=impl)
            (out.logps * weights).sum().backward()
            results[impl] = out, [p.grad.clone() for p in model.parameters()], max(saved)
        (plain, plain_grads, _), (lean, lean_grads, lean_saved) = results["plain"], results["lean"]
        torch.testing.assert_close(lean.logps, plain.logps, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lean.logits_sum, plain.logits_sum, rtol=1e-5, atol=1e-5)
        assert torch.equal(lean.tokens, plain.tokens)
        for got, want in zip(lean_grads, plain_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert lean_saved < batch.input_ids.numel() * vocab  # nothing of [T, V] size kept for backward


def test_lean_falls_back_to_plain_for_post_processed_logits():
    from transformers import AutoModelForCausalLM

    from ds_packdpo.model.logps import final_logit_softcap, lean_lm_head
    from ds_packdpo.model.build import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=64))
    assert lean_lm_head(model) is model.lm_head and final_logit_softcap(model) is None
    model.config.final_logit_softcapping = 30.0  # Gemma's soft-cap after the lm_head: the lean path applies it
    assert lean_lm_head(model) is model.lm_head and final_logit_softcap(model) == 30.0
    model.config.logit_scale = 0.5  # Cohere-style scaling after the lm_head: computed on the full logits
    assert lean_lm_head(model) is None


def test_a_log_prob_fallback_is_said_once_per_job(monkeypatch, capsys):
    """The guard inside forward_logps meets its cause at every step: rank 0 says it in one ``warning:`` line the
    first time, the other ranks never (a Python warning printed once per rank, with a file and line)."""
    import warnings

    from transformers import AutoModelForCausalLM

    from ds_packdpo import console
    from ds_packdpo.model.build import tiny_config
    from ds_packdpo.model.collate import collate_packed
    from ds_packdpo.model.guard import synthetic_pairs
    from ds_packdpo.model.logps import forward_logps

    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=64))
    model.config.logit_scale = 0.5
    batch = collate_packed(synthetic_pairs(2, 64, seed=0), [0, 1], 0)
    for rank in ("1", "0"):  # each rank a process of its own: its own memory of what it said
        monkeypatch.setattr(console, "_SAID_IN_THIS_PROCESS", set())
        monkeypatch.setenv("RANK", rank)
        for _step in range(2):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no Python warning either
                forward_logps(model, batch, "sdpa", impl="lean")
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["warning: lean log-probs: this model post-processes its logits or has no linear lm_head; "
                     "computing full logits instead"]


def test_auto_chunk_is_the_largest_under_half_the_floor_and_is_the_chunk_used(monkeypatch, tmp_path):
    """--logps-chunk-tokens auto: the chunk is the largest whose fp32 logits and gradient fit in half of the
    stage's floor ((T + V) x H elements), so it grows with the row, the width and the dtype's size and shrinks
    with the vocabulary; forward_logps runs that many tokens per chunk (counted), with the values of an explicit
    chunk; the flag takes 'auto' or a number and refuses anything else in one line."""
    from ds_packdpo.config import parse_train_args
    from ds_packdpo.run.assemble import logps_chunk
    from ds_packdpo.errors import InputError
    from ds_packdpo.model import logps
    from ds_packdpo.model.build import build_model
    from ds_packdpo.model.collate import collate_packed
    from ds_packdpo.model.guard import synthetic_pairs

    for tokens, hidden, vocab, size in [(8192, 512, 32000, 4), (16384, 4096, 128256, 2), (7, 3, 11, 4)]:
        chunk = logps.auto_chunk_tokens(tokens, hidden, vocab, size)
        floor = (tokens + vocab) * hidden * size
        assert 8 * chunk * vocab <= 0.5 * floor < 8 * (chunk + 1) * vocab or chunk == 1, (tokens, chunk)
    assert logps.auto_chunk_tokens(8192, 512, 32000, 4) == 160
    assert logps.auto_chunk_tokens(16384, 512, 32000, 4) > 160 > logps.auto_chunk_tokens(8192, 512, 64000, 4)
    assert logps.auto_chunk_tokens(8192, 512, 32000, 2) < 160 < logps.auto_chunk_tokens(8192, 1024, 32000, 4)

    vocab = 300
    model = build_model(None, "tiny", vocab, torch.float32, "sdpa", seed=0)
    batch = collate_packed(synthetic_pairs(6, vocab, seed=1), list(range(6)), 0)
    chunk = logps.auto_chunk_tokens(batch.input_ids.numel(), 64, vocab, 4)
    scored = int((batch.labels != -100).sum())
    assert 1 < chunk < scored // 2  # several chunks here, so the count below tells chunk sizes apart
    sizes = []
    real_chunk_logits = logps._chunk_logits
    monkeypatch.setattr(logps, "_chunk_logits", lambda chunk_, *a: sizes.append(chunk_.shape[0])
                        or real_chunk_logits(chunk_, *a))
    with torch.no_grad():
        auto = logps.forward_logps(model, batch, "sdpa")
        assert sizes[:-1] == [chunk] * (len(sizes) - 1) and sum(sizes) == scored
        sizes.clear()
        explicit = logps.forward_logps(model, batch, "sdpa", chunk_tokens=chunk + 3)
        assert sizes[0] == chunk + 3
    torch.testing.assert_close(auto.logps, explicit.logps, rtol=1e-7, atol=1e-6)  # other chunks: other matmul blocks

    assert logps_chunk(parse_train_args([])) == "auto"
    assert logps_chunk(parse_train_args(["--logps-chunk-tokens", "256"])) == 256
    for bad in ("0", "-3", "big", "1.5"):
        with pytest.raises(InputError, match="^--logps-chunk-tokens must be 'auto' or a number >= 1"):
            parse_train_args(["--logps-chunk-tokens", bad])
    config_file = tmp_path / "settings.json"  # a config file may give the count as a JSON number
    config_file.write_text(json.dumps({"logps_chunk_tokens": 96}))
    assert logps_chunk(parse_train_args(["--config", str(config_file)])) == 96
