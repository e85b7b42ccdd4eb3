"""Packing exactness on a CUDA machine: the architecture matrix with the varlen kernels (torch's own, flash-attn's)
in bf16, and the bf16 guard figures (body of gpu_check.sh and of gpu_acceptance.sh's first stage).

1. The matrix (``ds_packdpo.model.matrix``): every tiny architecture of ``model.build.ARCHITECTURES`` x every
   requested backend, packed rows and prefix-shared rows, log-probs and gradients against each sequence alone
   with eager attention; fp32 for the backends that run it (exact: <= 1e-5 on sums), bf16 for all (within the
   guard's per-token tolerance, gradients within 5e-2 relative).  The varlen kernels must also use the explicit
   ``cu_seqlens`` kwargs: no fallback that rediscovers the boundaries from position_ids (a device->host sync per
   layer: transformers' for flash-attn, ours for torch_varlen) may be called.
   torch_varlen's two semantics this package relies on are also probed directly: causal alignment when a segment
   has fewer queries than keys (bottom-right, the rejected block of a shared row), and whether torch's kernel
   takes unrepeated grouped KV heads without ``enable_gqa`` (torch 2.11 has no such argument).
2. The bf16 guard figures: the start-up guard's measure (mean |packed - eager alone| per completion token) on
   every architecture, and on a deeper random model (12 layers, hidden 768) with ~1,000-token sequences, against
   ``model.guard.HALF_ATOL_PER_TOKEN``: the figures the README's tolerance is checked against.
Prints one JSON object; exit status 1 when any check fails, 2 when there is no CUDA.
``--device cpu --attn sdpa_varlen,sdpa,eager`` runs the same code on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager

import torch
import transformers
from transformers import AutoModelForCausalLM

from ds_packdpo.data.plan import RowLayout
from ds_packdpo.errors import InputError
from ds_packdpo.model import attention, torch_varlen
from ds_packdpo.model.attention import BACKENDS, attn_implementation, check_model_attention
from ds_packdpo.model.build import ARCHITECTURES, build_model, tiny_config
from ds_packdpo.model.guard import HALF_ATOL_PER_TOKEN, guard_pairs, packing_exactness, synthetic_pairs
from ds_packdpo.model.matrix import VOCAB, matrix_outcome

FP32_LOGPS_ATOL = 1e-5
BF16_GRAD_RTOL = 5e-2
DEEP = {"hidden_size": 768, "layers": 12, "heads": 12, "kv_heads": 4}


@contextmanager
def count_boundary_rediscovery():
    """Counts calls of the position_ids -> cu_seqlens fallbacks: transformers' in the flash path, ours in
    sdpa_varlen/torch_varlen."""
    import transformers.modeling_flash_attention_utils as fa

    calls = {"n": 0}
    originals = [(fa, "_prepare_from_posids", fa._prepare_from_posids),
                 (attention, "_sequence_offsets", attention._sequence_offsets)]

    def counting(original):
        def call(*args, **kwargs):
            calls["n"] += 1
            return original(*args, **kwargs)
        return call

    for module, name, original in originals:
        setattr(module, name, counting(original))
    try:
        yield calls
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def matrix_entry(arch: str, attn: str, dtype: torch.dtype, device: str, shared_prefix: bool = False) -> dict:
    started = time.perf_counter()
    with count_boundary_rediscovery() as rediscovered:
        outcome = matrix_outcome(arch, attn, dtype, device, num_pairs=4,
                             layout=RowLayout.PREFIX_SHARED if shared_prefix else RowLayout.PACKED)
    if outcome["verdict"] == "refused":
        return {**outcome, "ok": True}
    if dtype == torch.float32:
        ok = outcome["logps_diff"] <= FP32_LOGPS_ATOL and outcome["grad_diff"] <= 1e-5 * outcome["grad_scale"]
    else:
        ok = (outcome["diff_per_token"] <= HALF_ATOL_PER_TOKEN
              and outcome["grad_diff"] <= BF16_GRAD_RTOL * outcome["grad_scale"])
    boundaries_ok = rediscovered["n"] == 0
    return {**outcome, "rows": "prefix-shared" if shared_prefix else "packed",
            "position_ids_boundary_rediscoveries": rediscovered["n"], "ok": bool(ok and boundaries_ok),
            "seconds": round(time.perf_counter() - started, 2)}


def shared_kernel_check(device: str, attns: list[str]) -> dict:
    """Each shared-row kernel alone in bf16 on ``device``: output and q/k/v gradients against dense fp32 attention
    built from the definition (a NaN anywhere fails it)."""
    from ds_packdpo.model.attention import PACKED_KERNELS
    from ds_packdpo.model.collate import PrefixLayout

    layout = PrefixLayout(((40, 17, 23), (9, 0, 30), (33, 21, 0), (5, 12, 8)))
    position, block, side = [], [], []
    for g, (p, c, r) in enumerate(layout.blocks):
        position += [*range(p), *range(p, p + c), *range(p, p + r)]
        block += [g] * (p + c + r)
        side += [0] * p + [1] * c + [2] * r
    position, block, side = (torch.tensor(x, device=device) for x in (position, block, side))
    visible = ((block[:, None] == block[None]) & (position[None] <= position[:, None])
               & ((side[None] == 0) | (side[None] == side[:, None])))
    generator = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(layout.tokens, heads, 64, device=device, generator=generator) for heads in (8, 2, 2))
    grad_out = torch.randn(q.shape, device=device, generator=generator)

    def dense(q, k, v):
        k, v = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
        scores = torch.einsum("thd,shd->hts", q, k) / 8.0
        return torch.einsum("hts,shd->thd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = dense(*leaves)
    want_grads = torch.autograd.grad(want, leaves, grad_out)
    report = {}
    for attn in attns:
        leaves = [t.bfloat16().requires_grad_() for t in (q, k, v)]
        out = PACKED_KERNELS[attn][1](*leaves, layout)
        grads = torch.autograd.grad(out, leaves, grad_out.bfloat16())
        diffs = [float((got.detach().float() - ref).abs().max()) for got, ref in zip((out, *grads), (want, *want_grads))]
        report[attn] = {"out": diffs[0], "dq": diffs[1], "dk": diffs[2], "dv": diffs[3],
                        "finite": bool(all(torch.isfinite(t).all() for t in (out, *grads)))}
        report[attn]["ok"] = report[attn]["finite"] and max(diffs) < 0.1
    return {**report, "ok": all(r["ok"] for r in report.values())}


def nonfinite_trace(device: str, attn: str, arch: str = "llama") -> dict:
    """Where a prefix-shared row of the tiny ``arch`` model in bf16 first goes non-finite: the modules whose forward
    outputs or input gradients hold NaN/inf, in call order (empty lists: all finite)."""
    from ds_packdpo.model.collate import collate_shared
    from ds_packdpo.model.logps import forward_logps
    from ds_packdpo.model.matrix import _model, matrix_pairs

    model = _model(arch, attn, torch.bfloat16, device)
    forward_bad, backward_bad = [], []

    def finite(tensors) -> bool:
        return all(torch.isfinite(t).all() for t in tensors if isinstance(t, torch.Tensor))

    for name, module in model.named_modules():
        module.register_forward_hook(lambda m, i, o, name=name: None if finite(o if isinstance(o, tuple) else (o,))
                                     else forward_bad.append(name))
        module.register_full_backward_hook(lambda m, gi, go, name=name: None if finite(gi) else
                                           backward_bad.append(name))
    pairs = matrix_pairs(4)
    row = collate_shared(pairs, list(range(len(pairs))), 0).to(device)
    result = forward_logps(model, row, attn)
    result.logps.sum().backward()
    bad_params = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    return {"arch": arch, "attn": attn, "forward_nonfinite": forward_bad[:8], "backward_nonfinite": backward_bad[:8],
            "params_nonfinite_grad": bad_params[:8], "logps_finite": bool(torch.isfinite(result.logps).all())}


def torch_varlen_semantics(device: str) -> dict:
    """torch_varlen's kernel against dense fp32 attention: which causal alignment it uses when a segment has fewer
    queries than keys, and whether it takes unrepeated grouped KV heads without ``enable_gqa``."""
    if torch_varlen.varlen_kernel() is None:
        return {"ok": False, "error": f"torch {torch.__version__} has no usable varlen_attn"}
    varlen_attn, takes_enable_gqa = torch_varlen.varlen_kernel()
    generator = torch.Generator(device=device).manual_seed(0)
    lq, lk, heads, kv_heads, dim = 24, 64, 8, 2, 64
    q = torch.randn(lq, heads, dim, device=device, generator=generator).bfloat16()
    k, v = (torch.randn(lk, kv_heads, dim, device=device, generator=generator).bfloat16() for _ in range(2))
    cu_q = torch.tensor([0, lq], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, lk], dtype=torch.int32, device=device)

    def dense(offset: int) -> torch.Tensor:  # query i sees keys j <= i + offset, fp32
        kr, vr = (t.float().repeat_interleave(heads // kv_heads, 1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q.float(), kr) / dim ** 0.5
        visible = torch.arange(lk, device=device)[None] <= torch.arange(lq, device=device)[:, None] + offset
        return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), vr)

    out = torch_varlen.segment_attention(q, k, v, cu_q, cu_k, lq, lk).float()
    bottom_right, top_left = ((out - dense(offset)).abs().max().item() for offset in (lk - lq, 0))
    result = {"takes_enable_gqa": takes_enable_gqa, "bottom_right_max_diff": bottom_right,
              "top_left_max_diff": top_left, "bottom_right": bool(bottom_right < 2e-2 < top_left)}
    if not takes_enable_gqa:
        try:
            unrepeated = varlen_attn(q, k, v, cu_q, cu_k, lq, lk, window_size=(-1, 0)).float()
            result["unrepeated_gqa_max_diff"] = (unrepeated - dense(lk - lq)).abs().max().item()
        except Exception as error:  # informational: the package repeats the heads on such a torch
            result["unrepeated_gqa_error"] = f"{type(error).__name__}: {error}"[:300]
    return {**result, "ok": result["bottom_right"]}


def guard_figures(attns: list[str], device: str) -> dict:
    """The guard's measure in bf16: each architecture (its guard pairs plus 8 random pairs), and a deeper model
    on ~1,000-token sequences."""
    figures = []
    for attn in attns:
        for arch in ARCHITECTURES:
            try:
                check_model_attention(tiny_config(arch, vocab_size=VOCAB), attn, arch)
            except InputError:
                continue  # refused: the matrix reports it
            model = build_model(None, f"tiny-{arch}", VOCAB, torch.bfloat16, attn, seed=0).to(device)
            pairs = guard_pairs(model, VOCAB) + synthetic_pairs(8, VOCAB, seed=5, max_tokens=48)
            result = packing_exactness(model, pairs, attn, 0)
            figures.append({"model": f"tiny-{arch}", "attn": attn, **{k: result[k] for k in (
                "max_abs_diff_logps", "max_diff_per_token", "longest_sequence")}})
        config = tiny_config("llama", vocab_size=32000, max_position_embeddings=8192, **DEEP)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            deep = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                    attn_implementation=attn_implementation(attn)).to(device)
        pairs = synthetic_pairs(2, 32000, seed=7, max_tokens=400, min_prompt_tokens=500)
        result = packing_exactness(deep, pairs, attn, 0)
        figures.append({"model": "llama 12 layers x 768", "attn": attn, **{k: result[k] for k in (
            "max_abs_diff_logps", "max_diff_per_token", "longest_sequence")}})
    worst = max(f["max_diff_per_token"] for f in figures)
    return {"tolerance_per_token": HALF_ATOL_PER_TOKEN, "worst_per_token": worst,
            "ok": bool(worst <= HALF_ATOL_PER_TOKEN), "figures": figures}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--attn", default="flash_attention_2,flash_attention_3,torch_varlen,sdpa_varlen,sdpa,eager",
                        help="comma-separated backends; flash_attention_3 is skipped when not installed")
    parser.add_argument("--dtypes", default="fp32,bf16",
                        help="comma-separated dtypes of the matrix for backends that run fp32 (the flash kernels: bf16)")
    parser.add_argument("--json-out", default=None, help="also write the JSON report to this file")
    parser.add_argument("--kernels-only", action="store_true",
                        help="only the shared-row kernels against dense attention and torch_varlen's semantics")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "torch sees no CUDA device", "torch": torch.__version__}))
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (TF32 would round matmuls to 10 bits)
    torch.backends.cudnn.allow_tf32 = False
    started = time.perf_counter()
    kernels = [a for a in args.attn.split(",") if a in ("sdpa_varlen", "torch_varlen")
               and (a != "torch_varlen" or args.device == "cuda")]
    if args.kernels_only:
        report = {"shared_kernels": shared_kernel_check(args.device, kernels), "torch": torch.__version__,
                  "nonfinite_traces": [nonfinite_trace(args.device, attn) for attn in kernels],
                  "torch_varlen_semantics": torch_varlen_semantics(args.device) if "torch_varlen" in kernels else None}
        report["ok"] = report["shared_kernels"]["ok"]
        print(json.dumps(report, indent=1))
        return 0 if report["ok"] else 1
    results, usable = [], []
    for attn in args.attn.split(","):
        if attn.startswith("flash_attention") and (args.device != "cuda" or BACKENDS[attn].missing(attn)):
            if attn != "flash_attention_3":  # optional: only checked where it is installed
                results.append({"attn": attn, "ok": False, "error": f"{attn} is not installed or not usable here"})
            continue
        if attn == "torch_varlen" and args.device != "cuda":
            continue
        usable.append(attn)
        # the flash kernels run half precision only; the others are checked in fp32 and bf16
        dtypes = [{"fp32": torch.float32, "bf16": torch.bfloat16}[name] for name in args.dtypes.split(",")]
        for dtype in [torch.bfloat16] if BACKENDS[attn].half_precision_only else dtypes:
            for arch in ARCHITECTURES:
                for shared_prefix in (False, True) if attn in ("sdpa_varlen", "torch_varlen") else (False,):
                    try:
                        results.append(matrix_entry(arch, attn, dtype, args.device, shared_prefix))
                    except Exception as error:  # report every backend, then fail
                        results.append({"arch": arch, "attn": attn, "dtype": str(dtype), "ok": False,
                                        "rows": "prefix-shared" if shared_prefix else "packed",
                                        "error": f"{type(error).__name__}: {error}"})
    guard = guard_figures([a for a in usable if a != "eager"], args.device)
    semantics = torch_varlen_semantics(args.device) if "torch_varlen" in usable else None
    report = {"ok": bool(results) and all(r["ok"] for r in results) and guard["ok"]
              and (semantics is None or semantics["ok"]), "device": args.device, "torch_varlen_semantics": semantics,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "torch": torch.__version__, "transformers": transformers.__version__,
              "seconds": round(time.perf_counter() - started, 1), "bf16_guard": guard, "matrix": results}
    print(json.dumps(report, indent=1))
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump(report, out, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
