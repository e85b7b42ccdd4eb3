"""The tune stage of scripts/gpu_acceptance.sh: the train stage once per variant, each in its own process, and one table.

    python scripts/gpu_tune.py OUT --variants default,compile --steps 4 --timeout-s 120 -- deepspeed ... --module \\
        ds_packdpo.train FLAGS...
    python scripts/gpu_tune.py stage-limit default,compile 120     # the stage's seconds: 360

Each variant is a row of :data:`VARIANTS`, or rows joined by '+': the flags it adds to the train command (a later flag
wins over the same one earlier).  A variant runs ``--max-steps STEPS`` into ``OUT/VARIANT`` with no start-up guard;
its figures are the means over its steps but the first (allocation, kernel selection, compilation).  Step 1 runs the
same initial weights on the same pairs in every variant, so its log-probs and gradient norm differ between variants
only by the lever's numerics: each row gives them relative to the first row's, the lever's exactness at the run's own
size (the matrix stage checks the default's against eager per sequence).  A variant that fails or runs out of time is
a row with its exit code and last line; the others still run.  OUT/tune.json holds every row, OUT/tune.md the table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# name -> the flags the variant adds to the train stage's command (the first row is the baseline)
VARIANTS: dict[str, tuple[str, ...]] = {
    "default": (),
    "compile": ("--compile-layers",),
    "liger": ("--liger-kernels",),
    "logps=fused": ("--logps-impl", "fused"),
    "logps=lean": ("--logps-impl", "lean"),
    "row-budget=16k": ("--max-tokens-per-row", "16384"),
    "row-budget=32k": ("--max-tokens-per-row", "32768"),
    "row-budget=64k": ("--max-tokens-per-row", "65536"),
    "zero3-prefetch=2e8": ("--zero-prefetch-bucket-size", "200000000"),
    "zero3-persist=1e6": ("--zero-param-persistence-threshold", "1000000"),
    # every policy parameter persistent (none has 2**31 elements): no gather or release per module, what ZeRO-3 costs
    "zero3-persist=all": ("--zero-param-persistence-threshold", str(2**31 - 1)),
    "ref-whole": ("--ref-whole",),
    "zero3-reduce-bucket=5e8": ("--zero-reduce-bucket-size", "500000000"),
    "no-overlap-comm": ("--no-zero-overlap-comm",),
    "activation-checkpointing": ("--gradient-checkpointing",),
}
# a variant with one of these parts gets its limit times the factor: compiling the layers falls in its first step
TIMEOUT_FACTOR = {"compile": 2.0}
FIGURES = ("tokens_per_s", "pairs_per_s", "mfu", "model_tflops_per_s")
FIRST_STEP = ("logps/chosen", "logps/rejected", "grad_norm")  # step 1's figures: same weights and pairs in every variant
FLAG_REL_DIFF = 1e-2  # a step-1 difference from the first row above this is drawn in bold: look before trusting its speed


def variant_flags(names: list[str]) -> list[tuple[str, tuple[str, ...]]]:
    """Each name's flags: a row of :data:`VARIANTS`, or rows joined by '+' (compile+row-budget=32k: both)."""
    unknown = [name for name in names if not all(part in VARIANTS for part in name.split("+"))]
    if unknown:
        raise SystemExit(f"error: TUNE_VARIANTS: {', '.join(unknown)} unknown (variants: {', '.join(VARIANTS)}, "
                         f"or several joined by +)")
    return [(name, tuple(flag for part in name.split("+") for flag in VARIANTS[part])) for name in names]


def variant_names(text: str) -> list[str]:
    """TUNE_VARIANTS's names (separated by commas or spaces)."""
    return [name for name in text.replace(" ", ",").split(",") if name]


def variant_timeout(name: str, timeout_s: float) -> float:
    """The variant's own limit: ``timeout_s`` times the largest :data:`TIMEOUT_FACTOR` of its parts."""
    return timeout_s * max((TIMEOUT_FACTOR.get(part, 1.0) for part in name.split("+")))


def stage_limit_s(text: str, timeout_s: float) -> int:
    """The whole stage's seconds: every variant's own limit (gpu_acceptance.sh gives its tune stage this)."""
    return int(sum(variant_timeout(name, timeout_s) for name in variant_names(text)))


def measure(metrics: list[dict]) -> dict:
    """The means over the steps after the first, the peak memory over all."""
    steps = [m for m in metrics if "step" in m and "loss" in m]
    measured = steps[1:]
    row = {key: (sum(m[key] for m in measured if m.get(key) is not None) / len(measured)
                 if measured and any(m.get(key) is not None for m in measured) else None) for key in FIGURES}
    return {**row, "steps": len(steps), "measured_steps": len(measured),
            "peak_mem_mb": max((m.get("peak_mem_mb") or 0 for m in steps), default=None),
            "losses": [m["loss"] for m in steps], "first_step": {key: steps[0].get(key) for key in FIRST_STEP}
            if steps else None}


def first_step_differences(rows: list[dict]) -> None:
    """Adds to each row its step 1's largest relative log-prob difference (chosen or rejected) and gradient-norm
    difference from the first row's (None where either run has no step 1)."""
    base = rows[0].get("first_step") if rows else None

    def rel(key: str, row: dict) -> float | None:
        got, want = (row.get("first_step") or {}).get(key), (base or {}).get(key)
        return None if got is None or want is None else abs(got - want) / max(abs(want), 1e-30)

    for row in rows:
        logps = [rel(key, row) for key in FIRST_STEP[:2]]
        row["first_step_logps_rel_diff"] = None if None in logps else max(logps)
        row["first_step_grad_norm_rel_diff"] = rel("grad_norm", row)


def run_variant(name: str, flags: tuple[str, ...], command: list[str], out: Path, steps: int, timeout_s: float) -> dict:
    folder = out / name.replace("=", "_").replace("+", "_")
    argv = [*command, *flags, "--max-steps", str(steps), "--skip-packing-check", "--output-dir", str(folder),
            "--overwrite"]
    started = time.perf_counter()
    log = out / f"{folder.name}.log"
    with log.open("w") as handle:
        process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)

        def end_variant(*_):  # the stage's own limit (SIGTERM from timeout): the variant's launcher and rank too
            os.killpg(process.pid, signal.SIGKILL)
            raise SystemExit(124)

        signal.signal(signal.SIGTERM, end_variant)
        try:
            rc = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # the launcher and its rank, the whole session
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            rc = 124
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    try:
        metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        metrics = []
    row = {"variant": name, "flags": list(flags), "rc": rc, "seconds": round(time.perf_counter() - started, 1),
           **measure(metrics)}
    if rc != 0:
        errors = [line for line in lines if line.startswith(("error:", "Traceback")) or "Error" in line]
        row["error"] = (errors or lines or ["(no output)"])[-1][:300]
    return row


def describe(rows: list[dict]) -> list[str]:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    def diff(value):
        return "-" if value is None else f"**{value:.1e}**" if value > FLAG_REL_DIFF else f"{value:.1e}"

    base = rows[0].get("tokens_per_s") if rows else None
    lines = ["| variant | flags | tokens/s | vs first | MFU | TFLOP/s | peak MB | step-1 logps vs first | "
             "step-1 grad norm vs first | steps | s | exit |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        ratio = r["tokens_per_s"] / base if base and r.get("tokens_per_s") else None
        logps, grad = (None, None) if i == 0 else (r.get("first_step_logps_rel_diff"),
                                                   r.get("first_step_grad_norm_rel_diff"))
        lines.append(f"| {r['variant']} | {' '.join(r['flags']) or '-'} | {fmt(r.get('tokens_per_s'), ',.0f')} | "
                     f"{fmt(ratio, '.3f')} | {fmt(r.get('mfu'), '.3f')} | {fmt(r.get('model_tflops_per_s'), '.1f')} | "
                     f"{fmt(r.get('peak_mem_mb'), ',.0f')} | {diff(logps)} | {diff(grad)} | {r['measured_steps']} | "
                     f"{r['seconds']} | {r['rc']} |")
    lines += [f"- {r['variant']}: {r['error']}" for r in rows if r.get("error")]
    lines += [f"- step 1 runs the same weights on the same pairs in every variant: its log-probs and gradient norm "
              f"relative to the first row's are the lever's numerics (bold: over {FLAG_REL_DIFF:g})"]
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["stage-limit"]:  # gpu_tune.py stage-limit VARIANTS SECONDS: the stage's limit, printed
        print(stage_limit_s(argv[1], float(argv[2])))
        return 0
    if "--" not in argv:
        raise SystemExit("usage: gpu_tune.py OUT --variants A,B [--steps N] [--timeout-s S] -- TRAIN COMMAND...")
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--variants", default="default")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timeout-s", type=float, default=120.0,
                        help="each variant's limit (a compiling variant's: twice it, TIMEOUT_FACTOR)")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    variants = variant_flags(variant_names(args.variants))
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, flags in variants:
        rows.append(run_variant(name, flags, command, args.out, args.steps, variant_timeout(name, args.timeout_s)))
        first_step_differences(rows)
        (args.out / "tune.json").write_text(json.dumps({"steps": args.steps, "command": command, "rows": rows},
                                                       indent=1))
        (args.out / "tune.md").write_text("\n".join(describe(rows)) + "\n")
        print(json.dumps(rows[-1]), flush=True)
    print("\n".join(describe(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
