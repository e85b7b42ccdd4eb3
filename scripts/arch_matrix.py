"""Prints the architecture matrix as the README's Markdown table: per tiny architecture and backend, "exact" with
the largest difference of packed per-sequence log-prob sums (and of gradients, relative) against each sequence
alone with eager attention, or "refused" (phase one's one-line error).  What tests/test_architectures.py asserts.

    DS_ACCELERATOR=cpu .venv/bin/python scripts/arch_matrix.py [--attn sdpa_varlen,sdpa,eager] [--device cpu]
"""

from __future__ import annotations

import argparse

import torch

from ds_packdpo.model.attention import attention_features
from ds_packdpo.model.build import ARCHITECTURES, tiny_config
from ds_packdpo.model.matrix import VOCAB, matrix_outcome

EXACT_ATOL = 1e-5
# What the config does not say: the layers' own peculiarities each architecture brings into the matrix.
NOTES = {"qwen3": "q/k norm per head", "olmo2": "q/k norm over all heads", "phi3": "fused qkv"}


def features(arch: str) -> str:
    found = attention_features(tiny_config(arch, vocab_size=VOCAB))
    text = tiny_config(arch, vocab_size=VOCAB)
    parts = []
    if found["sliding_window"]:
        types = getattr(text, "layer_types", None)
        kinds = "every layer" if types is None else "/".join(t.split("_")[0] for t in types)
        parts.append(f"window {found['sliding_window']} ({kinds})")
    if found["attn_logit_softcapping"]:
        parts.append(f"attention cap {found['attn_logit_softcapping']:g}")
    if found["final_logit_softcapping"]:
        parts.append(f"final cap {found['final_logit_softcapping']:g}")
    if getattr(text, "num_experts", None):
        parts.append(f"{text.num_experts} experts, top {text.num_experts_per_tok}")
    if arch in NOTES:
        parts.append(NOTES[arch])
    return ", ".join(parts) or "-"


def cell(outcome: dict) -> str:
    if outcome["verdict"] == "refused":
        return "refused"
    exact = outcome["logps_diff"] <= EXACT_ATOL and outcome["grad_diff"] <= 1e-5 * outcome["grad_scale"]
    return (f"{'exact' if exact else 'NOT EXACT'} ({outcome['logps_diff']:.1e} / "
            f"{outcome['grad_diff'] / outcome['grad_scale']:.0e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attn", default="sdpa_varlen,sdpa,eager")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny models: the thread pool only costs
    backends = args.attn.split(",")
    print("| architecture (config class) | attention features | " + " | ".join(f"`{b}`" for b in backends) + " |")
    print("|---|---|" + "---|" * len(backends))
    for arch, (config_class, _) in ARCHITECTURES.items():
        cells = [cell(matrix_outcome(arch, attn, device=args.device)) for attn in backends]
        print(f"| `tiny-{arch}` ({config_class}) | {features(arch)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
