"""The step profile (--profile-steps): the categoriser's table on a recorded CPU profile and on CUDA kernel names,
and the profiler's window."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import AutoModelForCausalLM

from ds_packdpo.model.attention import attn_implementation
from ds_packdpo.model.build import tiny_config
from ds_packdpo.model.collate import collate_packed
from ds_packdpo.model.guard import synthetic_pairs
from ds_packdpo.model.logps import forward_logps
from ds_packdpo.run.profile_categories import (CATEGORIES, IDLE, OPTIMIZER_SCOPE, STEP_SCOPE, Activity, categorize,
                                               describe_breakdown, step_breakdown, union_micros)
from ds_packdpo.run.step_profiler import StepProfiler, profile_activities


@pytest.fixture(scope="module")
def cpu_profile():
    """Two training steps of a tiny Llama (packed row, sdpa_varlen, lean log-probs, AdamW) recorded on the CPU."""
    vocab = 512
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=vocab),
                                             attn_implementation=attn_implementation("sdpa_varlen"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = collate_packed(synthetic_pairs(4, vocab, seed=1), [0, 1, 2, 3], 0)
    forward_logps(model, batch, "sdpa_varlen", chunk_tokens=16).logps.sum().backward()  # warm-up, unprofiled
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as recorded:
        for _ in range(2):
            with record_function(STEP_SCOPE):
                forward_logps(model, batch, "sdpa_varlen", chunk_tokens=16).logps.sum().backward()
                with record_function(OPTIMIZER_SCOPE):
                    optimizer.step()
                optimizer.zero_grad()
    return profile_activities(recorded.events(), "cpu")


def test_a_recorded_cpu_step_lands_in_its_stages(cpu_profile):
    """Each stage the step ran has time (attention, the layers' GEMMs with their FLOPs, the log-prob stage forward
    and backward, the optimizer); categories and idle add up to the step (one thread, nothing overlaps)."""
    activities, busy, windows = cpu_profile
    assert len(windows) == 2
    table = step_breakdown(activities, busy, windows, "cpu")
    rows = {row["category"]: row for row in table["categories"]}
    assert set(rows) == {c.name for c in CATEGORIES} | {IDLE}
    for name in ("attention", "gemm", "logps", "optimizer", "elementwise"):
        assert rows[name]["ms_per_step"] > 0, name
    assert rows["gemm"]["gflop_per_step"] > 0 and rows["logps"]["gflop_per_step"] > 0  # the head's product
    assert rows["zero3_gather"]["ms_per_step"] == rows["reduce_scatter"]["ms_per_step"] == 0  # no process group
    total = sum(row["ms_per_step"] for row in table["categories"])
    assert total == pytest.approx(table["step_ms"], rel=0.02)
    # the backward of the lean head (its autograd node) is the log-prob stage's, not elementwise
    head_backward = [a for a in activities if any("LeanLabelLogProbBackward" in s for s in a.scopes) and a.micros]
    assert head_backward and {categorize(a) for a in head_backward} == {"logps"}
    lines = describe_breakdown(table)
    assert lines[0].startswith("Step time by category (cpu, 2 profiled steps") and len(lines) == 4 + len(rows)


@pytest.mark.parametrize("name, scopes, category", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", ("aten::mm", "aten::linear"), "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", ("aten::addmm",), "gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", ("aten::_flash_attention_forward",),
     "attention"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", ("aten::mm", "ds_packdpo.logps"), "logps"),
    ("void at::native::vectorized_elementwise_kernel<4, MulFunctor>", ("aten::mul", "_LeanLabelLogProbBackward"),
     "logps"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", ("c10d::_allgather_base_",),
     "zero3_gather"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", ("c10d::_reduce_scatter_base_",), "reduce_scatter"),
    ("void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor>", (), "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, MulFunctor>", ("aten::mul", OPTIMIZER_SCOPE), "optimizer"),
    ("Memcpy HtoD (Pageable -> Device)", (), "memory"),
    ("void at::native::vectorized_elementwise_kernel<4, SiluFunctor>", ("aten::silu",), "elementwise"),
    ("void (anonymous namespace)::rms_norm_kernel<float>", ("aten::mul",), "elementwise"),
])
def test_cuda_kernel_names_by_category(name, scopes, category):
    assert categorize(Activity(name, scopes, 1.0)) == category


def test_idle_is_the_window_no_activity_covers():
    """Overlapping kernels count once in the busy time; what falls outside the step windows does not count."""
    assert union_micros([(0, 10), (5, 20), (30, 40), (100, 200)], [(0, 50)]) == 30
    table = step_breakdown([Activity("gemm", (), 15.0), Activity("ncclDevKernel_AllGather", (), 10.0)],
                           [(0, 15), (5, 15)], [(0, 20)], "cuda")
    rows = {row["category"]: row for row in table["categories"]}
    assert rows[IDLE]["ms_per_step"] == pytest.approx(5e-3) and rows["gemm"]["share"] == pytest.approx(0.75)


@pytest.mark.parametrize("profile_steps, total, start, window", [
    (2, 4, 0, (2, 3)),  # the first step is left out
    (2, 2, 0, (1, 2)),  # a run of 2 steps: both
    (3, 2, 0, (1, 2)),  # fewer steps than asked: what there is
    (2, 10, 5, (7, 8)),  # a resumed run: its own first step left out
    (0, 4, 0, None),
])
def test_profiled_steps(profile_steps, total, start, window):
    profiler = StepProfiler(profile_steps, total, start, "cpu", None)
    assert ((profiler.first, profiler.last) if profiler.last else None) == window
