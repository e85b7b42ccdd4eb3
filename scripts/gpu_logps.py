"""The log-prob stage on a GPU: lean chunks vs the fused kernel (cut-cross-entropy) vs full logits; prints JSON.

One packed row of final hidden states ``[T, H]`` (bf16) and an lm_head ``[V, H]``: per-token log-probs of the
completion tokens, then backward into the hidden states and the head's weight.  Per implementation: peak memory
above the inputs (``torch.cuda.max_memory_allocated``), the median time of ``--runs`` forward + backward passes
(CUDA events), and the largest difference of the per-sequence sums from an fp32 computation of the same bf16
inputs (per token, the guard's unit), and of the gradients relative to their largest value.

    python scripts/gpu_logps.py --tokens 16384 --vocab 128256 --hidden 4096 --json-out logps.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from ds_packdpo.model import fused_logps
from ds_packdpo.model.logps import auto_chunk_tokens, lean_token_logps


def plain_token_logps(hidden, labels, head):
    rows = (labels.reshape(-1) != -100).nonzero().squeeze(1)
    logits = head(hidden.reshape(-1, hidden.shape[-1])[rows]).float()
    return torch.log_softmax(logits, dim=-1).gather(1, labels.reshape(-1)[rows, None]).squeeze(1).double()


def lean(hidden, labels, head, chunk):
    return lean_token_logps(hidden, labels, head, chunk)[1]


def fused(hidden, labels, head):
    rows = (labels.reshape(-1) != -100).nonzero().squeeze(1)
    selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
    return fused_logps.fused_token_logps(selected, labels.reshape(-1)[rows], head.weight)[0]


def measure(name, fn, hidden, labels, head, seq, sequences, runs):
    """Peak memory, median time, per-sequence sums and gradients of ``fn``."""
    weights = torch.linspace(-1.0, 1.0, sequences, device=hidden.device, dtype=torch.float64)
    times, sums, grads = [], None, None
    for _ in range(runs):
        hidden.grad = head.weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        token_logps = fn(hidden, labels, head)
        sums = torch.zeros(sequences, dtype=torch.float64, device=hidden.device).index_add_(0, seq, token_logps)
        (sums * weights).sum().backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
        peak = torch.cuda.max_memory_allocated() - base
        grads = (hidden.grad.float().clone(), head.weight.grad.float().clone())
    return {"name": name, "peak_mb": peak / 2**20, "median_s": statistics.median(times[1:] or times)}, sums.detach(), grads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--sequence-tokens", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.normal_(0, args.hidden ** -0.5)
    hidden = torch.randn(1, args.tokens, args.hidden, device=device, dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(0, args.vocab, (1, args.tokens), device=device)
    position = torch.arange(args.tokens, device=device)
    labels[0, position % args.sequence_tokens < args.sequence_tokens // 4] = -100  # a prompt quarter per sequence
    sequences = -(-args.tokens // args.sequence_tokens)
    seq = (position // args.sequence_tokens)[labels[0] != -100]
    chunk = auto_chunk_tokens(args.tokens, args.hidden, args.vocab, 2)
    fp32_head = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=device)
    with torch.no_grad():
        fp32_head.weight.copy_(head.weight.float())
    oracle = torch.zeros(sequences, dtype=torch.float64, device=device).index_add_(
        0, seq, plain_token_logps(hidden.detach().float(), labels, fp32_head))
    completion_tokens = int((labels != -100).sum())
    report = {"tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "completion_tokens": completion_tokens,
              "lean_chunk_tokens": chunk, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "fused_available": fused_logps.linear_cross_entropy is not None, "runs": []}
    impls = [("plain", plain_token_logps), ("lean", lambda h, y, w: lean(h, y, w, chunk))]
    if report["fused_available"]:
        impls.append(("fused", fused))
    reference_grads = None
    for name, fn in impls:
        try:
            figures, sums, grads = measure(name, fn, hidden, labels, head, seq, sequences, args.runs)
        except torch.OutOfMemoryError as error:
            report["runs"].append({"name": name, "error": str(error).splitlines()[0]})
            torch.cuda.empty_cache()
            continue
        figures["sum_diff_per_token_vs_fp32"] = float((sums - oracle).abs().max()) / args.sequence_tokens
        if reference_grads is None:
            reference_grads = grads
        figures["grad_diff_vs_plain"] = [float((g - r).abs().max() / r.abs().max())
                                         for g, r in zip(grads, reference_grads)]
        report["runs"].append(figures)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as handle:
            handle.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
