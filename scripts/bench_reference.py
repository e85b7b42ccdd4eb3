"""Step time and peak memory of short 2-rank training runs: live vs precomputed reference, lean vs plain log-probs.

One ``precompute-ref`` launch, then one training launch per configuration, all with
the same flags.  Per configuration it reports the median ``step_time_s`` of the
steps after the first (the first includes warm-up) and the peak resident set of
the largest process of the launch (``ru_maxrss`` of the launcher's children: the
biggest rank), and the loss trajectory, so the figures come from runs that
trained the same thing.  Prints JSON.

    .venv/bin/python scripts/bench_reference.py --out-dir /tmp/bench_reference
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")
CONFIGS = {
    "live_reference+lean": [],
    "live_reference+plain": ["--logps-impl", "plain"],
    "precomputed_reference+lean": ["--ref-logps", "REF"],
    "precomputed_reference+plain": ["--ref-logps", "REF", "--logps-impl", "plain"],
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(module: str, procs: int, flags: list[str]) -> int:
    """Runs a deepspeed launch to completion; returns the peak RSS (bytes) of its largest process.

    Each launch runs in a fresh ``python -c`` so that RUSAGE_CHILDREN covers this launch alone.
    """
    env = {**os.environ, "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    cmd = [DEEPSPEED, "--num_gpus", str(procs), "--master_port", str(free_port()), "--module", module, *flags]
    probe = ("import resource, subprocess, sys, json; rc = subprocess.call(sys.argv[1:]); "
             "print(json.dumps({'rc': rc, 'maxrss': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))")
    out = subprocess.run([sys.executable, "-c", probe, *cmd], env=env, cwd=REPO, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["rc"] != 0:
        raise SystemExit(f"launch failed ({result['rc']}): {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return result["maxrss"] * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000, help="model vocabulary (the tokenizer's is smaller)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--max-tokens-per-row", type=int, default=2048)
    parser.add_argument("--pairs", type=int, default=96)
    parser.add_argument("--global-batch-pairs", type=int, default=16)
    args = parser.parse_args()

    from ds_packdpo.model.build import tiny_config

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_config = out / "model_config.json"
    tiny_config(vocab_size=args.vocab, hidden_size=args.hidden, layers=args.layers).to_json_file(model_config)
    common = ["--model-config", str(model_config), "--synthetic-pairs", str(args.pairs), "--max-length",
              str(args.max_length), "--max-tokens-per-row", str(args.max_tokens_per_row), "--global-batch-pairs",
              str(args.global_batch_pairs), "--dtype", "fp32", "--cache-dir", str(out / "cache"),
              "--no-progress", "--overwrite"]
    ref = out / "reference.jsonl"
    precompute_rss = launch("ds_packdpo.precompute_ref", args.procs, ["--out", str(ref), *common])
    report = {"setting": {**vars(args), "model": {"vocab": args.vocab, "hidden": args.hidden, "layers": args.layers}},
              "precompute_peak_rss_mib": precompute_rss / 2**20}
    for name, flags in CONFIGS.items():
        run_dir = out / name
        flags = [str(ref) if f == "REF" else f for f in flags]
        rss = launch("ds_packdpo.train", args.procs, ["--output-dir", str(run_dir), "--max-steps", str(args.steps),
                                                      "--lr", "1e-4", *common, *flags])
        steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        report[name] = {
            "median_step_time_s": statistics.median(s["step_time_s"] for s in steps[1:]),
            "step_times_s": [round(s["step_time_s"], 3) for s in steps],
            "peak_rss_largest_rank_mib": rss / 2**20,
            "loss": [round(s["loss"], 6) for s in steps],
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
