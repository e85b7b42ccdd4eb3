"""Packing exactness on a CUDA machine: the architecture matrix with flash-attn varlen and bf16, and the bf16 guard
figures (body of gpu_check.sh; under 5 minutes on one GPU once flash-attn is installed).

1. The matrix (``ds_packdpo.model.matrix``): every tiny architecture of ``model.build.ARCHITECTURES`` x every
   requested backend, packed log-probs and gradients against each sequence alone with eager attention; fp32 for
   the backends that run it (exact: <= 1e-5 on sums), bf16 for all (within the guard's per-token tolerance,
   gradients within 5e-2 relative).  Flash backends must also use the explicit ``cu_seqlens`` kwargs: transformers'
   fallback that rediscovers the boundaries from position_ids (a device->host sync) must not be called.
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

from ds_packdpo.errors import InputError
from ds_packdpo.model.attention import (attn_implementation, check_model_attention, flash_attention_available,
                                        is_flash)
from ds_packdpo.model.build import ARCHITECTURES, build_model, tiny_config
from ds_packdpo.model.guard import HALF_ATOL_PER_TOKEN, guard_pairs, packing_exactness, synthetic_pairs
from ds_packdpo.model.matrix import VOCAB, matrix_outcome

FP32_LOGPS_ATOL = 1e-5
BF16_GRAD_RTOL = 5e-2
DEEP = {"hidden_size": 768, "layers": 12, "heads": 12, "kv_heads": 4}


@contextmanager
def count_boundary_rediscovery():
    """Counts calls of transformers' position_ids -> cu_seqlens fallback in the flash path."""
    import transformers.modeling_flash_attention_utils as fa

    calls = {"n": 0}
    original = fa._prepare_from_posids

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    fa._prepare_from_posids = counting
    try:
        yield calls
    finally:
        fa._prepare_from_posids = original


def matrix_entry(arch: str, attn: str, dtype: torch.dtype, device: str) -> dict:
    started = time.perf_counter()
    with count_boundary_rediscovery() as rediscovered:
        outcome = matrix_outcome(arch, attn, dtype, device, num_pairs=4)
    if outcome["verdict"] == "refused":
        return {**outcome, "ok": True}
    if dtype == torch.float32:
        ok = outcome["logps_diff"] <= FP32_LOGPS_ATOL and outcome["grad_diff"] <= 1e-5 * outcome["grad_scale"]
    else:
        ok = (outcome["diff_per_token"] <= HALF_ATOL_PER_TOKEN
              and outcome["grad_diff"] <= BF16_GRAD_RTOL * outcome["grad_scale"])
    boundaries_ok = not is_flash(attn) or rediscovered["n"] == 0
    return {**outcome, "position_ids_boundary_rediscoveries": rediscovered["n"], "ok": bool(ok and boundaries_ok),
            "seconds": round(time.perf_counter() - started, 2)}


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
    parser.add_argument("--attn", default="flash_attention_2,flash_attention_3,sdpa_varlen,sdpa,eager",
                        help="comma-separated backends; flash_attention_3 is skipped when not installed")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "torch sees no CUDA device", "torch": torch.__version__}))
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (TF32 would round matmuls to 10 bits)
    torch.backends.cudnn.allow_tf32 = False
    started = time.perf_counter()
    results, usable = [], []
    for attn in args.attn.split(","):
        if is_flash(attn) and (args.device != "cuda" or not flash_attention_available(attn)):
            if attn != "flash_attention_3":  # optional: only checked where it is installed
                results.append({"attn": attn, "ok": False, "error": f"{attn} is not installed or not usable here"})
            continue
        usable.append(attn)
        # flash kernels run half precision only; the others are checked in fp32 and bf16
        for dtype in [torch.bfloat16] if is_flash(attn) else [torch.float32, torch.bfloat16]:
            for arch in ARCHITECTURES:
                try:
                    results.append(matrix_entry(arch, attn, dtype, args.device))
                except Exception as error:  # report every backend, then fail
                    results.append({"arch": arch, "attn": attn, "dtype": str(dtype), "ok": False,
                                    "error": f"{type(error).__name__}: {error}"})
    guard = guard_figures([a for a in usable if a != "eager"], args.device)
    report = {"ok": bool(results) and all(r["ok"] for r in results) and guard["ok"], "device": args.device,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "torch": torch.__version__, "transformers": transformers.__version__,
              "seconds": round(time.perf_counter() - started, 1), "bf16_guard": guard, "matrix": results}
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
