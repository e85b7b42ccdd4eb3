"""torch_varlen (PyTorch's FlashAttention varlen kernel) wired exactly, tested through an emulation of its semantics.

The kernel is CUDA only; ``tests/varlen_emulation.py`` computes what torch documents for ``varlen_attn`` (causal
as ``window_size=(-1, 0)``, windows as ``(W - 1, 0)``, bottom-right alignment, ``enable_gqa`` in torch 2.13, none in
2.11).  Here: the calls this package makes against the CPU kernels (packed and prefix-shared rows, grouped heads,
windows; values and gradients), the whole architecture matrix against eager one sequence at a time, the choice of
``--attn auto`` and every refusal.  The real kernel runs in scripts/gpu_acceptance.sh.
"""

from __future__ import annotations

import pytest
import torch

from ds_packdpo.config import parse_train_args
from ds_packdpo.data.plan import RowLayout
from ds_packdpo.errors import InputError
from ds_packdpo.model import attention, prefix_attention, torch_varlen
from ds_packdpo.model.attention import check_model_attention, model_forward_kwargs, resolve_attn, varlen_attention
from ds_packdpo.model.build import ARCHITECTURES, build_model, tiny_config
from ds_packdpo.model.collate import PrefixLayout, collate_packed
from ds_packdpo.model.guard import synthetic_pairs
from ds_packdpo.model.logps import forward_logps
from ds_packdpo.model.matrix import VOCAB, matrix_outcome
from ds_packdpo.run import sequence_parallel
from ds_packdpo.run.assemble import prepare

from varlen_emulation import emulated_torch_varlen, emulated_torch_varlen_2_11, use_torch_varlen_emulation

LAYOUT = PrefixLayout(((5, 3, 4), (1, 0, 6), (7, 4, 0), (1, 9, 2), (6, 0, 0), (3, 5, 5)))


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def qkv(tokens: int, seed: int, kv_heads: int = 2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, heads, 16, generator=g, requires_grad=True) for heads in (8, kv_heads, kv_heads)]


def values_and_grads(fn, q, k, v):
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    return out, grads


def assert_same(got, want):
    (out, grads), (want_out, want_grads) = got, want
    assert (out - want_out).abs().max() <= 1e-5
    for grad, reference in zip(grads, want_grads, strict=True):
        assert (grad - reference).abs().max() <= 1e-5 * reference.abs().max()


@pytest.mark.parametrize("kernel", [emulated_torch_varlen, emulated_torch_varlen_2_11])
@pytest.mark.parametrize("window", [None, 3, 100])
def test_packed_and_shared_rows_equal_the_cpu_kernels(monkeypatch, kernel, window):
    """One varlen call per row: packed rows against sdpa_varlen's per-sequence loop, prefix-shared rows against the
    CPU shared-prefix kernel; grouped heads (enable_gqa in torch 2.13, as they are in 2.11), windows shorter and
    longer than the sequences; values and gradients."""
    use_torch_varlen_emulation(monkeypatch, kernel)
    cu = torch.tensor([0, 5, 6, 13, 20], dtype=torch.int32)
    q, k, v = qkv(20, seed=1)
    assert_same(values_and_grads(lambda *t: torch_varlen.packed_attention(*t, cu, 7, scale=0.3, sliding_window=window),
                                 q, k, v),
                values_and_grads(lambda *t: varlen_attention(*t, cu, scale=0.3, sliding_window=window), q, k, v))
    q, k, v = qkv(LAYOUT.tokens, seed=2)
    assert_same(values_and_grads(lambda *t: torch_varlen.shared_prefix_attention(*t, LAYOUT, 0.25, window), q, k, v),
                values_and_grads(lambda *t: prefix_attention.shared_prefix_attention(*t, LAYOUT, 0.25, window),
                                 q, k, v))
    with pytest.raises(NotImplementedError, match="no soft-capping"):
        torch_varlen.packed_attention(q, k, v, torch.tensor([0, LAYOUT.tokens]), LAYOUT.tokens, softcap=2.0)
    with pytest.raises(ValueError, match="covers 61 tokens, the row has 50"):
        torch_varlen.shared_prefix_attention(q[:50], k[:50], v[:50], LAYOUT)


def test_window_size_is_torchs_causal_tuple():
    """torch decides causality by ``window_size == (-1, 0)``: a list would run bidirectional attention."""
    assert torch_varlen.window_size(None) == (-1, 0) and isinstance(torch_varlen.window_size(None), tuple)
    assert torch_varlen.window_size(4) == (3, 0)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_matrix_packed_and_shared_rows_equal_eager_alone(monkeypatch, arch):
    """Every architecture with torch_varlen (emulated, fp32): packed and prefix-shared rows against each sequence
    alone with eager attention, on sequences longer than the window; Gemma 2 (attention soft-cap) refused."""
    use_torch_varlen_emulation(monkeypatch)
    for shared in (False, True):
        outcome = matrix_outcome(arch, "torch_varlen", layout=RowLayout.PREFIX_SHARED if shared else RowLayout.PACKED)
        if arch == "gemma2":
            assert outcome["verdict"] == "refused" and "\n" not in outcome["message"]
            assert outcome["message"].startswith("--attn torch_varlen: --model-config tiny-gemma2 (gemma2) soft-caps")
            assert "use --attn flash_attention_2 (flash-attn >= 2.6) or sdpa_varlen" in outcome["message"]
            return
        window = outcome["sliding_window"]
        assert window is None or outcome["shortest_sequence"] > window
        assert outcome["logps_diff"] <= 1e-5 and outcome["grad_diff"] <= 1e-5 * outcome["grad_scale"], outcome


def test_the_row_boundaries_reach_the_kernel_unchanged(monkeypatch):
    """A packed row's cu_seqlens and max length go from the collated batch to every layer's one varlen call (no
    rediscovery from position ids, no per-sequence loop)."""
    calls = []

    def recording(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **options):
        calls.append((cu_seq_q.tolist(), cu_seq_k.tolist(), max_q, max_k, options["window_size"]))
        return emulated_torch_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **options)

    use_torch_varlen_emulation(monkeypatch, recording)
    monkeypatch.setattr(torch_varlen, "varlen_kernel", lambda: (recording, True))
    monkeypatch.setattr(attention, "_sequence_offsets", None)  # the fallback must not be taken
    model = build_model(None, "tiny-qwen2", VOCAB, torch.float32, "torch_varlen", seed=1)
    batch = collate_packed(synthetic_pairs(3, VOCAB, seed=4), [0, 1, 2], 0)
    assert set(model_forward_kwargs(batch, "torch_varlen")) >= {"cu_seq_lens_q", "max_length_q"}
    with torch.no_grad():
        forward_logps(model, batch, "torch_varlen")
    cu = batch.cu_seqlens.tolist()
    layers = model.config.num_hidden_layers
    windows = [(-1, 0) if kind == "full_attention" else (model.config.sliding_window - 1, 0)
               for kind in model.config.layer_types]
    assert calls == [(cu, cu, batch.max_seqlen, batch.max_seqlen, window) for window in windows] and len(calls) == layers


def test_auto_prefers_flash_then_torch_varlen_on_cuda_in_half_precision(monkeypatch):
    flash, varlen = set(), True
    monkeypatch.setattr(attention, "flash_attention_available", lambda name: name in flash)
    monkeypatch.setattr(torch_varlen, "torch_varlen_available", lambda: varlen)
    assert resolve_attn("auto", "cuda", dtype="bf16") == "torch_varlen"
    assert resolve_attn("auto", "cuda", dtype="fp16") == "torch_varlen"
    assert resolve_attn("auto", "cuda", dtype="fp32") == "sdpa_varlen"  # the flash kernels take half precision only
    assert resolve_attn("auto", "cpu", dtype="bf16") == "sdpa_varlen"
    flash.add("flash_attention_2")
    assert resolve_attn("auto", "cuda", dtype="bf16") == "flash_attention_2"
    flash.clear()
    varlen = False  # a torch before 2.11, or no CUDA
    assert resolve_attn("auto", "cuda", dtype="bf16") == "sdpa_varlen"


def test_explicit_torch_varlen_is_refused_where_it_cannot_run(monkeypatch):
    for device, dtype, needle in [("cpu", "bf16", "--attn torch_varlen: needs a CUDA device, this run is on cpu"),
                                  ("cuda", "fp32", "--attn torch_varlen with --dtype fp32: flash attention kernels "
                                                   "run bf16/fp16 only")]:
        with pytest.raises(InputError, match=needle):
            resolve_attn("torch_varlen", device, dtype=dtype)
    monkeypatch.setattr(torch_varlen, "varlen_kernel", lambda: None)
    with pytest.raises(InputError, match=r"has no varlen_attn with window_size \(torch >= 2.11 has it\).* sdpa_varlen"):
        resolve_attn("torch_varlen", "cuda", dtype="bf16")
    monkeypatch.setattr(torch_varlen, "varlen_kernel", lambda: (emulated_torch_varlen, True))
    assert resolve_attn("torch_varlen", "cuda", dtype="bf16") == "torch_varlen"
    monkeypatch.undo()  # the real probe on this machine's torch (2.13: it has the kernel; no CUDA here)
    assert torch_varlen.varlen_kernel() is not None and not torch_varlen.torch_varlen_available()


def test_other_layer_kinds_and_soft_caps_are_refused_in_phase_one():
    config = tiny_config("llama", attention_chunk_size=16)
    with pytest.raises(InputError, match="attention_chunk_size, which the per-sequence causal kernel"):
        check_model_attention(config, "torch_varlen", "--model m")
    with pytest.raises(InputError, match="soft-caps its attention scores"):
        check_model_attention(tiny_config("gemma2", vocab_size=VOCAB), "torch_varlen", "--model m")


def test_sequence_parallel_runs_torch_varlen_as_its_local_kernel(monkeypatch, tmp_path):
    """Under Ulysses the local kernels are torch_varlen's (packed and shared rows), and phase one accepts it; on
    this CPU machine a run with --attn torch_varlen stops in phase one, in one line."""
    assert sequence_parallel.local_attention_for("torch_varlen") is torch_varlen.packed_attention
    assert sequence_parallel.local_shared_attention_for("torch_varlen") is torch_varlen.shared_prefix_attention
    assert sequence_parallel.local_attention_for("sdpa") is attention.sdpa_segments
    sequence_parallel.check_attention("torch_varlen", 2)
    cfg = parse_train_args(["--synthetic-pairs", "8", "--output-dir", str(tmp_path / "out"), "--attn", "torch_varlen"])
    with pytest.raises(InputError, match="^--attn torch_varlen: needs a CUDA device"):
        prepare(cfg, "train", world_size=1)
    assert not (tmp_path / "out").exists()


def test_sdpa_varlen_gives_way_on_cuda_in_half_precision(capsys):
    """sdpa_varlen's shared rows gave non-finite gradients on an H200 in bf16: there the default sharing gives way in
    one warning line and a written --prefix-sharing is refused; fp32, the CPU and the varlen kernels still share."""
    from ds_packdpo.model.attention import prefix_sharing_obstacle
    from ds_packdpo.run.assemble import settle_row_layout
    from ds_packdpo.run.layout import ParallelLayout

    assert prefix_sharing_obstacle("sdpa_varlen", 1, "cuda", "bf16").startswith("sdpa_varlen's prefix-shared rows")
    for attn, device, dtype in [("sdpa_varlen", "cuda", "fp32"), ("sdpa_varlen", "cpu", "bf16"),
                                ("torch_varlen", "cuda", "bf16"), ("flash_attention_2", "cuda", "bf16")]:
        assert prefix_sharing_obstacle(attn, 1, device, dtype) is None, (attn, device, dtype)
    assert prefix_sharing_obstacle("sdpa_varlen", 2, "cuda", "bf16") is None  # Ulysses' local kernel: its own rule
    layout = ParallelLayout(world_size=1, rank=0, sp_size=1)
    default = parse_train_args(["--synthetic-pairs", "8", "--dtype", "bf16"])
    def settle_prefix_sharing(cfg, attn, layout, device):
        return settle_row_layout(cfg.row_layout, cfg.is_given("prefix_sharing"), attn, layout, device, cfg.dtype,
                                 "train")

    assert not settle_prefix_sharing(default, "sdpa_varlen", layout, "cuda").shares_prefixes
    assert capsys.readouterr().err.startswith("warning: --attn sdpa_varlen: prefix sharing off (sdpa_varlen's")
    assert settle_prefix_sharing(default, "sdpa_varlen", layout, "cpu").shares_prefixes
    written = parse_train_args(["--synthetic-pairs", "8", "--dtype", "bf16", "--prefix-sharing"])
    with pytest.raises(InputError, match=r"^--attn sdpa_varlen: prefix sharing .* run sdpa_varlen$"):
        settle_prefix_sharing(written, "sdpa_varlen", layout, "cuda")
