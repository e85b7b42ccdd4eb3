"""Packing exactness on a CUDA machine, flash-attention varlen included (body of gpu_check.sh).

For tiny random Llama and Qwen2 models and each requested backend it measures:
  * the guard (`packing_exactness`): packed row vs each sequence alone;
  * packed vs padded per-sequence log-probs and DPO-loss gradients;
  * for flash backends, that the packed forward used the explicit cu_seqlens kwargs:
    transformers' fallback that rediscovers boundaries from position_ids (a device->host
    sync) must not be called.
Prints one JSON object; exit status 1 when any check fails, 2 when there is no CUDA.
`--device cpu --attn sdpa,eager` is a dry run of the same code on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager

import torch

from ds_packdpo.model.attention import flash_attention_available, is_flash
from ds_packdpo.model.collate import collate_packed, collate_padded
from ds_packdpo.model.logps import SequenceLogps, forward_logps
from ds_packdpo.model.losses import LossConfig, global_normalized_loss, pair_losses
from ds_packdpo.model.build import build_model
from ds_packdpo.model.guard import packing_exactness, synthetic_pairs

VOCAB = 1024
# fp32 must agree like on CPU; bf16 rounds differently per layout (reported, to calibrate the guard).
LOGPS_TOL = {torch.float32: ("absolute", 1e-4), torch.bfloat16: ("relative", 1e-3)}
GRAD_RTOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


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


def dpo_grads(model, batch, attn, reference):
    model.zero_grad(set_to_none=True)
    losses, _ = pair_losses(forward_logps(model, batch, attn), reference, LossConfig("sigmoid", beta=0.5))
    global_normalized_loss(losses, batch.num_pairs, 1).backward()
    return {name: p.grad.float().clone() for name, p in model.named_parameters()}


def check_one(arch: str, attn: str, dtype: torch.dtype, device: str, pairs_count: int) -> dict:
    started = time.perf_counter()
    model = build_model(None, arch, VOCAB, dtype, attn, seed=0).to(device)
    pairs = synthetic_pairs(pairs_count, VOCAB, seed=3, max_tokens=48)
    guard = packing_exactness(model, pairs, attn, pad_token_id=0)
    index = list(range(len(pairs)))
    packed = collate_packed(pairs, index, 0).to(device)
    padded = collate_padded(pairs, index, 0).to(device)

    with count_boundary_rediscovery() as rediscovered:
        packed_logps = forward_logps(model, packed, attn)
    padded_logps = forward_logps(model, padded, attn)
    difference = (packed_logps.logps - padded_logps.logps).abs().detach()
    kind, tol = LOGPS_TOL[dtype]
    measured = difference / padded_logps.logps.detach().abs().clamp_min(1.0) if kind == "relative" else difference
    logps_ok = bool(measured.max() <= tol)

    with torch.no_grad():
        ref = forward_logps(model, packed, attn)
        reference = SequenceLogps(ref.logps + torch.linspace(-1, 1, ref.logps.numel(), device=device),
                                  ref.tokens, ref.logits_sum)
    grads_packed = dpo_grads(model, packed, attn, reference)
    grads_padded = dpo_grads(model, padded, attn, reference)
    grad_rel = max(float((grads_packed[n] - g).norm() / g.norm().clamp_min(1e-12)) for n, g in grads_padded.items())
    grads_ok = grad_rel <= GRAD_RTOL[dtype]

    boundaries_ok = not is_flash(attn) or rediscovered["n"] == 0
    return {
        "arch": arch, "attn": attn, "dtype": str(dtype).removeprefix("torch."), "pairs": pairs_count,
        "guard": guard,
        "packed_vs_padded_max_abs_diff_logps": float(difference.max()),
        "packed_vs_padded_logps_tolerance": [kind, tol],
        "packed_vs_padded_max_rel_diff_grads": grad_rel, "grad_rtol": GRAD_RTOL[dtype],
        "position_ids_boundary_rediscoveries": rediscovered["n"],
        "ok": bool(guard["ok"] and logps_ok and grads_ok and boundaries_ok),
        "seconds": round(time.perf_counter() - started, 2),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--attn", default="flash_attention_2,flash_attention_3,sdpa_varlen,sdpa,flex_attention",
                        help="comma-separated backends; flash_attention_3 is skipped when not installed")
    parser.add_argument("--pairs", type=int, default=8)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "torch sees no CUDA device", "torch": torch.__version__}))
        return 2

    results = []
    for attn in args.attn.split(","):
        if is_flash(attn) and (args.device != "cuda" or not flash_attention_available(attn)):
            if attn == "flash_attention_3":
                continue  # optional: only checked where it is installed
            results.append({"attn": attn, "ok": False, "error": f"{attn} is not installed or not usable here"})
            continue
        # flash kernels run half precision only; the others are checked in fp32 and bf16
        dtypes = [torch.bfloat16] if is_flash(attn) else [torch.float32, torch.bfloat16]
        for arch in ("tiny", "tiny-qwen2"):
            for dtype in dtypes:
                try:
                    results.append(check_one(arch, attn, dtype, args.device, args.pairs))
                except Exception as error:  # report every backend, then fail
                    results.append({"arch": arch, "attn": attn, "dtype": str(dtype), "ok": False,
                                    "error": f"{type(error).__name__}: {error}"})
    import transformers

    report = {"ok": bool(results) and all(r["ok"] for r in results), "device": args.device,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "torch": torch.__version__, "transformers": transformers.__version__, "results": results}
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
