"""Peak memory and time of the log-prob stage, lean vs plain, on CPU; prints JSON.

The stage: final hidden states [1, T, H] -> per-sequence completion log-probs ->
backward into the hidden states and the lm_head weight.  ``plain`` applies the
lm_head to the whole row and reduces the [T, V] logits (ds_packdpo.model.logps.sequence_logps);
``lean`` is ds_packdpo.model.logps.lean_token_logps (chunks of completion tokens, recomputed in
backward).

Peak memory: torch's CPU allocations are invisible to tracemalloc, so every
measurement runs in a fresh subprocess and reports the process's peak resident set
(``ru_maxrss``) minus its resident set just before the stage (inputs, weights and
torch's own start-up already counted in the baseline).  Time: the median of
``--runs`` stages inside the subprocess, as wall time and as CPU time of the
process (with one thread the CPU time does not count the time other processes
hold the core, so it is the steadier figure on a shared machine); the
subprocesses of both variants alternate ``--repeats`` times, and the report gives
the medians.

    .venv/bin/python scripts/bench_logps.py --tokens 8192 --vocab 32000 --hidden 512 [--token-stats]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def chunk_tokens(args) -> int:
    """--chunk-tokens, or for 'auto' the chunk training would use on this row (4-byte fp32 weights)."""
    from ds_packdpo.model.logps import auto_chunk_tokens

    if args.chunk_tokens == "auto":
        return auto_chunk_tokens(args.tokens, args.hidden, args.vocab, 4)
    return int(args.chunk_tokens)


def child(args) -> dict:
    import torch

    from ds_packdpo.model.logps import _lean_logps_at, _per_sequence, _plain_logps_at

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False)

    def row(tokens: int):
        """A packed row of sequences of --sequence-tokens, the first quarter of each a prompt (no label)."""
        hidden = torch.randn(1, tokens, args.hidden).requires_grad_()
        seq_index = (torch.arange(tokens) // args.sequence_tokens)[None]
        labels = torch.randint(0, args.vocab, (1, tokens))
        labels[(torch.arange(tokens) % args.sequence_tokens < args.sequence_tokens // 4)[None]] = -100
        return hidden, labels, seq_index, int(seq_index.max()) + 1

    def stage(hidden, labels, seq_index, sequences):
        flat = labels.reshape(-1)
        rows = (flat != -100).nonzero().squeeze(1)
        if args.variant == "plain":
            scored = _plain_logps_at(head(hidden), rows, flat[rows], chunk_tokens(args), stats=args.token_stats)
        else:
            scored = _lean_logps_at(hidden, rows, flat[rows], head, chunk_tokens(args), stats=args.token_stats)
        seqs = _per_sequence(seq_index.reshape(-1)[rows], scored, sequences)
        (seqs.logps * torch.linspace(-1, 1, sequences)).sum().backward()
        hidden.grad = head.weight.grad = None

    stage(*row(args.sequence_tokens))  # warm-up: torch's lazy initialisation is not part of the stage
    inputs = row(args.tokens)
    baseline = _rss_bytes()
    seconds, cpu_seconds = [], []
    for _ in range(args.runs):
        start, cpu_start = time.perf_counter(), time.process_time()
        stage(*inputs)
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"variant": args.variant, "peak_bytes": peak - baseline, "seconds": statistics.median(seconds),
            "cpu_seconds": statistics.median(cpu_seconds),
            "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--sequence-tokens", type=int, default=512)
    parser.add_argument("--chunk-tokens", default="auto", help="a number, or auto (--logps-chunk-tokens auto)")
    parser.add_argument("--token-stats", action="store_true",
                        help="also the entropy and argmax hits (TRL's metrics), as the policy's training forward")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--runs", type=int, default=3, help="stages per subprocess (median time)")
    parser.add_argument("--repeats", type=int, default=3, help="subprocesses per variant, alternating")
    parser.add_argument("--variant", choices=("plain", "lean"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(child(args)))
        return
    results = {"plain": [], "lean": []}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
             if k not in ("variant", "repeats", "token_stats")] + (["--token-stats"] if args.token_stats else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    for _ in range(args.repeats):
        for variant in results:
            out = subprocess.run([sys.executable, __file__, *flags, f"--variant={variant}"], env=env, check=True,
                                 capture_output=True, text=True).stdout
            results[variant].append(json.loads(out.strip().splitlines()[-1]))
    summary = {variant: {"peak_mib": statistics.median(r["peak_bytes"] for r in runs) / 2**20,
                         "seconds": statistics.median(r["seconds"] for r in runs),
                         "cpu_seconds": statistics.median(r["cpu_seconds"] for r in runs),
                         "all_peak_mib": [round(r["peak_bytes"] / 2**20, 1) for r in runs],
                         "all_seconds": [round(r["seconds"], 3) for r in runs],
                         "all_cpu_seconds": [round(r["cpu_seconds"], 3) for r in runs]}
               for variant, runs in results.items()}
    print(json.dumps({
        "setting": {k: v for k, v in vars(args).items() if k != "variant"},
        "chunk_tokens": chunk_tokens(args),
        "floor_mib": (args.tokens + args.vocab) * args.hidden * 4 / 2**20,  # hidden states + lm_head gradient
        "threads": results["plain"][0]["threads"],
        **summary,
        "memory_ratio_plain_over_lean": summary["plain"]["peak_mib"] / summary["lean"]["peak_mib"],
        "time_ratio_lean_over_plain": summary["lean"]["seconds"] / summary["plain"]["seconds"],
        "cpu_time_ratio_lean_over_plain": summary["lean"]["cpu_seconds"] / summary["plain"]["cpu_seconds"],
    }, indent=2))


if __name__ == "__main__":
    main()
