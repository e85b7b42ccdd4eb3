"""Sequence parallelism: slicing and labels (pure), Ulysses + all-reduced log-probs on 2 in-process gloo ranks.

The end-to-end trajectory under --sequence-parallel-size 2 (with pairs longer than one
rank's budget) is a layout of tests/test_trainer_multirank.py, next to the references it equals.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.multiprocessing as mp

from ds_packdpo.model.attention import ULYSSES_ATTN, sdpa_segments
from ds_packdpo.model.collate import IGNORE_INDEX, PrefixLayout, collate_packed, collate_shared
from ds_packdpo.errors import InputError
from ds_packdpo.model.build import tiny_config
from ds_packdpo.model.guard import synthetic_pairs
from ds_packdpo.run.layout import ParallelLayout
from ds_packdpo.run.sequence_parallel import (check_model_heads, kv_replication,
                                          slice_row)

PAD = 3


def test_slices_keep_next_token_labels_across_boundaries():
    """Every slice's labels are the full row's: the last token of slice r is labelled with slice r+1's first token."""
    row = collate_packed(synthetic_pairs(3, vocab_size=128, seed=8, max_tokens=20), [0, 1, 2], PAD)
    length = row.input_ids.shape[1]
    for sp_size in (2, 3, 4):
        slices = [slice_row(row, sp_size, r, PAD) for r in range(sp_size)]
        ids = torch.cat([s.input_ids for s in slices], dim=1)[0]
        labels = torch.cat([s.labels for s in slices], dim=1)[0]
        pad = ids.numel() - length
        assert 0 <= pad < sp_size and len({s.input_ids.shape[1] for s in slices}) == 1
        assert torch.equal(ids[:length], row.input_ids[0]) and torch.equal(labels[:length], row.labels[0])
        assert (ids[length:] == PAD).all() and (labels[length:] == IGNORE_INDEX).all()
        # label rule on the concatenation: a scored label is the next token of the row, also at slice ends
        scored = (labels != IGNORE_INDEX).nonzero().squeeze(1)
        assert torch.equal(labels[scored], ids[scored + 1])
        for r in range(sp_size - 1):
            last = slices[r].labels[0, -1]
            assert last == IGNORE_INDEX or last == slices[r + 1].input_ids[0, 0]
        if sp_size == 2:  # this row (121 tokens) has a completion cut in two by the S=2 boundary
            assert slices[0].labels[0, -1] == slices[1].input_ids[0, 0] != IGNORE_INDEX
        # every slice carries the whole padded row's boundaries, the pad being its own segment
        cu = slices[0].cu_seqlens
        assert cu[-1] == ids.numel() and all(torch.equal(s.cu_seqlens, cu) for s in slices)
        assert torch.equal(cu[:row.cu_seqlens.numel()], row.cu_seqlens)


def test_slices_of_a_shared_row_keep_fork_labels_and_the_whole_layout():
    row = collate_shared(synthetic_pairs(3, vocab_size=128, seed=8, max_tokens=20), [0, 1, 2], PAD)
    for sp_size in (2, 3):
        slices = [slice_row(row, sp_size, r, PAD) for r in range(sp_size)]
        pad = sum(s.input_ids.shape[1] for s in slices) - row.input_ids.shape[1]
        fork = torch.cat([s.fork_labels for s in slices], dim=1)[0]
        assert torch.equal(fork[:row.input_ids.shape[1]], row.fork_labels[0]) and (fork[len(fork) - pad:] == -100).all()
        # every rank attends over the whole padded row: the pad is a block of its own
        assert all(s.prefix_layout == PrefixLayout(row.prefix_layout.blocks + ((pad, 0, 0),) * bool(pad))
                   for s in slices)
        assert slices[0].prefix_layout.tokens == sp_size * slices[0].input_ids.shape[1]


def test_sdpa_segments_equals_block_diagonal_attention():
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    q, k, v = torch.randn(13, 4, 8), torch.randn(13, 2, 8), torch.randn(13, 2, 8)
    out = sdpa_segments(q, k, v, cu, 7)
    seg = torch.repeat_interleave(torch.arange(3), torch.diff(cu))
    pos = torch.arange(13)
    mask = (seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :])
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=mask).transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)


def test_layout_checks():
    """One layout object says every size and rank; consecutive ranks share a row."""
    layouts = [ParallelLayout(world_size=4, sp_size=2, rank=r, zero_stage=3) for r in range(4)]
    assert [(x.dp_size, x.dp_rank, x.sp_rank, x.counts_metrics) for x in layouts] == [
        (2, 0, 0, True), (2, 0, 1, False), (2, 1, 0, True), (2, 1, 1, False)]
    assert layouts[0].as_dict() == {"world_size": 4, "dp_size": 2, "sp_size": 2}
    assert layouts[0].describe() == "4 ranks (2 data-parallel x 2 sequence-parallel)"
    # ZeRO-3's reduce-scatter divides by the whole world, stages 0-2 by the data-parallel size
    assert layouts[0].gradient_divisor == 4 and ParallelLayout(4, 2, 0, zero_stage=2).gradient_divisor == 2
    assert ParallelLayout(3, 1, 2, zero_stage=2).gradient_divisor == 3
    with pytest.raises(InputError, match="--sequence-parallel-size 3 does not divide the world size 4"):
        ParallelLayout(4, 3)
    with pytest.raises(InputError, match="rank 2 is outside a world of 2"):
        ParallelLayout(2, 1, rank=2)
    assert [kv_replication(kv, 4) for kv in (1, 2, 4, 8)] == [4, 2, 1, 1]
    check_model_heads(tiny_config(heads=4, kv_heads=1), 4, "--model-config tiny")
    with pytest.raises(InputError) as error:
        check_model_heads(tiny_config(heads=6, kv_heads=2, hidden_size=48), 4, "--model-config m.json")
    message = str(error.value)
    assert "--sequence-parallel-size 4" in message and "6 attention heads" in message and "m.json" in message


# ----------------------------------------------------------------------------- two in-process gloo ranks


def _model(kv_heads: int, attn: str, arch: str = "llama"):
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, vocab_size=128, hidden_size=64, layers=2, heads=4, kv_heads=kv_heads)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)


def _loss(logps):
    """A nonlinear loss of whole-sequence log-probs (as DPO's; LD-weighted, and the plain sums besides), so a wrong
    reduction shows in the gradient."""
    return (torch.nn.functional.logsigmoid(0.1 * (logps.chosen_logps - logps.rejected_logps)).sum()
            + 0.01 * logps.unweighted_logps.sum())


def _rank_main(rank: int, port: int, results):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import deepspeed

    from ds_packdpo.model.logps import TokenWeighting, forward_logps
    from ds_packdpo.run.process_group import release_shm_buffer
    from ds_packdpo.run.sequence_parallel import init_sequence_parallel

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    release_shm_buffer()
    sp, _ = init_sequence_parallel(ParallelLayout(2, 2, rank), "sdpa", PAD)
    # pairs long enough that sequences straddle the slice boundary; odd total length exercises the padding
    pairs = synthetic_pairs(3, vocab_size=128, seed=8, max_tokens=20)
    row = collate_packed(pairs, [0, 1, 2], PAD)
    shared_row = collate_shared(pairs, [0, 1, 2], PAD)  # the same pairs, each prompt once
    out = {}
    # 1 KV head < S=2: replicated; Mistral (every layer a window of 8 tokens) and Gemma 2 (sliding + full layers,
    # attention and final soft-caps) against eager: the local kernel applies each layer's window and cap
    for name, kv_heads, arch, attn in ((2, 2, "llama", "sdpa"), (1, 1, "llama", "sdpa"),
                                       ("mistral", 2, "mistral", "eager"), ("gemma2", 2, "gemma2", "eager")):
        full, split = _model(kv_heads, attn, arch), _model(kv_heads, ULYSSES_ATTN, arch)
        weighting = TokenWeighting(ld_alpha=0.5, wpo=True)  # LD sums and WPO's statistic summed over the slices
        expected = forward_logps(full, row, attn, weighting=weighting)
        _loss(expected).backward()
        full_grads = torch.cat([p.grad.reshape(-1) for p in full.parameters()])
        for prefix, batch in (("", row), ("shared_", shared_row)):
            split.zero_grad(set_to_none=True)
            got = sp.forward_logps(split, batch, ULYSSES_ATTN, weighting=weighting)
            _loss(got).backward()
            grads = torch.cat([p.grad.reshape(-1) for p in split.parameters()])
            torch.distributed.all_reduce(grads)  # DeepSpeed's reduction sums the ranks' partial gradients
            out.setdefault(name, {}).update({
                f"{prefix}length": batch.input_ids.shape[1],
                f"{prefix}logps_diff": float((got.logps - expected.logps).abs().max()),
                f"{prefix}tokens_equal": bool(torch.equal(got.tokens, expected.tokens)),
                f"{prefix}logits_diff": float((got.logits_sum - expected.logits_sum).abs().max()),
                f"{prefix}plain_diff": float((got.plain_logps - expected.plain_logps).abs().max()),
                f"{prefix}wpo_diff": float((got.wpo_sum - expected.wpo_sum).abs().max()),
                f"{prefix}grad_rel": float((grads - full_grads).norm() / grads.norm()),
            })
    results[rank] = out


@pytest.mark.multirank
def test_ulysses_logps_and_gradients_equal_one_rank():
    """S=2 on 2 gloo ranks: whole-sequence log-probs equal the unsplit forward, and the summed gradients equal its
    gradient -- for the packed row and for the same pairs prefix-shared (the shared-prefix kernel after the
    all-to-all), both against the unsplit unshared row (Mistral and Gemma 2: with their sliding windows and soft-caps,
    against eager).  LD-DPO's weighted sums (a pair's shared length straddling the slices) and WPO's statistic
    too."""
    from launching import free_port

    results = mp.Manager().dict()
    mp.spawn(_rank_main, args=(free_port(), results), nprocs=2, join=True)
    assert set(results[0]) == {2, 1, "mistral", "gemma2"}
    for rank in (0, 1):
        for kv_heads, res in results[rank].items():
            assert res["length"] % 2 == 1 and res["shared_length"] % 2 == 1, res  # both rows padded to S
            for name in ("", "shared_"):
                assert res[f"{name}logps_diff"] < 1e-4 and res[f"{name}logits_diff"] < 1e-3, (rank, kv_heads, res)
                assert res[f"{name}plain_diff"] < 1e-4 and res[f"{name}wpo_diff"] < 1e-4, (rank, kv_heads, res)
                assert res[f"{name}tokens_equal"], (rank, kv_heads, res)
                assert res[f"{name}grad_rel"] < 1e-5, (rank, kv_heads, res)


IMPOSSIBLE_LAYOUTS = [
    # the budget the S=2 layout of test_trainer_multirank.py trains with is refused at S=1, naming the way out
    ({}, ["--max-tokens-per-row", "100"],
     r"^error: pair \d+ needs 1\d\d tokens .* but --max-tokens-per-row is 100; .* --sequence-parallel-size$"),
    ({"WORLD_SIZE": "3"}, ["--sequence-parallel-size", "3"],
     r"^error: --sequence-parallel-size 3: --model-config tiny has 4 attention heads, not divisible by 3"),
]


def test_impossible_layout_fails_before_process_group(tmp_path):
    from launching import main_per_case
    from test_bad_input import assert_one_line_error

    cases = [(["--output-dir", str(tmp_path / f"out{case}"), "--cache-dir", str(tmp_path / "cache"),
               "--synthetic-pairs", "48", "--max-length", "96", *flags], env)
             for case, (env, flags, _) in enumerate(IMPOSSIBLE_LAYOUTS)]
    results = main_per_case("ds_packdpo.train", cases)
    for case, ((_, _, message), (code, stderr)) in enumerate(zip(IMPOSSIBLE_LAYOUTS, results, strict=True)):
        last = assert_one_line_error(code, stderr)
        assert re.search(message, last), last
        assert not (tmp_path / f"out{case}").exists()
