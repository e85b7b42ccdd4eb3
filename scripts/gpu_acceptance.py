"""Helpers of scripts/gpu_acceptance.sh: the inputs of its runs, TRL's baseline run, and the summary.

    python scripts/gpu_acceptance.py setup WORK [--smoke | --bench-model]   # model config, tokenizer, DeepSpeed config
    python scripts/gpu_acceptance.py trl WORK OUT.json --steps N --batch-pairs B --micro-batch-pairs M
    python scripts/gpu_acceptance.py summarize OUT            # OUT/acceptance.json and OUT/acceptance.md

The model is a randomly initialised Llama-3.2-1B-shaped config (hidden 2048, 16 layers, 32 heads, 8 KV heads,
intermediate 8192, vocab 128,256, tied embeddings; nothing downloaded); ``--smoke`` writes a tiny one instead so the
whole script can be tried on a CPU, and ``--bench-model`` the bench's default model (Llama, hidden 256, 4 layers,
vocab 4096) for the CPU comparison with TRL (docs/figures.md).  The tokenizer is the local byte-level BPE of the README's benchmark, trained on
dpo_en_demo.json.  TRL's baseline trains the same model, data, pairs per step and maximum length with TRL's own
DPOTrainer (padded batches, its default), fp32 weights with bf16 autocast, the same as our ZeRO-3 bf16 engine's fp32
master weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# gpu_acceptance.sh names the file (../shared/data, or its copy in .gpu_data/ on a machine without ../shared)
DATA = Path(os.environ.get("DPO_DEMO_DATA", REPO.parent / "shared" / "data" / "dpo_en_demo.json"))
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
            "rope_theta": 500000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-5}
SMOKE = {**LLAMA_1B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 4096}
H200_BF16_DENSE_TFLOPS = 989.0  # the datasheet's dense bf16 peak, for MFU


def setup(work: Path, smoke: bool, bench_model: bool) -> None:
    from transformers import LlamaConfig

    from ds_packdpo.bench import BENCH_MODEL
    from ds_packdpo.data.tokenizer import train_bpe_tokenizer
    from ds_packdpo.model.build import tiny_config

    work.mkdir(parents=True, exist_ok=True)
    if bench_model:
        tiny_config("llama", vocab_size=4096, **BENCH_MODEL).save_pretrained(work / "model")
    else:
        LlamaConfig(**(SMOKE if smoke else LLAMA_1B)).save_pretrained(work / "model")
    rows = json.loads(DATA.read_text())
    texts = [t for r in rows for t in [m["value"] for m in r["conversations"]] + [r["chosen"]["value"],
                                                                                  r["rejected"]["value"]]]
    train_bpe_tokenizer(texts, vocab_size=4096).save_pretrained(str(work / "tokenizer"))
    # The built-in ZeRO-3 config with torch's AdamW: DeepSpeed's FusedAdam would JIT-compile with nvcc first.
    ds = json.loads((REPO / "ds_packdpo" / "ds_configs" / "zero3.json").read_text())
    ds["optimizer"]["params"]["torch_adam"] = True
    (work / "zero3_torch_adam.json").write_text(json.dumps(ds, indent=2))
    shape = "bench" if bench_model else "smoke" if smoke else "Llama-3.2-1B-shaped"
    print(f"setup: {work} ({shape} model, tokenizer, DeepSpeed config)")


def trl_rows(rows: list[dict]) -> list[dict]:
    """dpo_en_demo's ShareGPT rows in TRL's conversational preference layout."""
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    return [{"prompt": [{"role": roles[m["from"]], "content": m["value"]} for m in r["conversations"]],
             "chosen": [{"role": "assistant", "content": r["chosen"]["value"]}],
             "rejected": [{"role": "assistant", "content": r["rejected"]["value"]}]} for r in rows]


def trl_baseline(work: Path, out: Path, steps: int, batch_pairs: int, micro_batch_pairs: int, max_length: int) -> None:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    cuda = torch.cuda.is_available()
    tokenizer = AutoTokenizer.from_pretrained(str(work / "tokenizer"))
    config = AutoConfig.from_pretrained(str(work / "model"))

    def random_model():  # the same weights each call, as our policy and reference engines start
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")

    model, reference = random_model(), random_model().eval()
    dataset = Dataset.from_list(trl_rows(json.loads(DATA.read_text())))

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    clock = StepClock()
    args = DPOConfig(output_dir=str(work / "trl_out"), per_device_train_batch_size=micro_batch_pairs,
                     gradient_accumulation_steps=batch_pairs // micro_batch_pairs, max_steps=steps,
                     learning_rate=1e-6, beta=0.1, max_length=max_length, bf16=cuda, logging_steps=1,
                     report_to="none", save_strategy="no", dataloader_num_workers=0, seed=0,
                     use_cpu=not cuda)
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=dataset,
                         processing_class=tokenizer, callbacks=[clock])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer.train()
    measured = clock.ends[1:]  # step 1 (warm-up, allocator growth) is not measured
    seconds = measured[-1] - clock.ends[0] if len(measured) >= 1 else None
    report = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "steps": steps,
              "measured_steps": len(measured), "pairs_per_step": batch_pairs,
              "micro_batch_pairs": micro_batch_pairs, "max_length": max_length, "attn": "sdpa",
              "precision": "fp32 weights, bf16 autocast" if cuda else "fp32",
              "pairs_per_s": batch_pairs * len(measured) / seconds if seconds else None,
              "step_seconds": [round(b - a, 3) for a, b in zip(clock.ends[:-1], clock.ends[1:])],
              "wall_seconds": round(time.perf_counter() - started, 1),
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
              "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def _fmt(value, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def summarize(out: Path) -> int:
    """acceptance.json (every figure, with the stages' exit codes) and acceptance.md (the README's tables)."""
    stages = _read_jsonl(out / "stages.jsonl")
    matrix = _read_json(out / "matrix.json") or {}
    train_metrics = _read_jsonl(out / "train" / "metrics.jsonl")
    train_plan = _read_json(out / "train" / "plan_summary.json")
    bench = _read_json(out / "bench" / "report.json") or {}
    bench_groups = _read_json(out / "bench_groups" / "report.json") or {}
    trl_report = _read_json(out / "trl.json")
    steps = [m for m in train_metrics if "loss" in m and "step" in m]
    measured = steps[1:]  # the first step pays allocation and kernel selection

    def mean(key: str):
        values = [m[key] for m in measured if m.get(key) is not None]
        return sum(values) / len(values) if values else None

    train = {"steps": len(steps), "measured_steps": len(measured), "plan": train_plan,
             "tokens_per_s": mean("tokens_per_s"), "pairs_per_s": mean("pairs_per_s"), "mfu": mean("mfu"),
             "model_tflops_per_s": mean("model_tflops_per_s"),
             "peak_memory": max((m.get("peak_mem_mb") or 0 for m in steps), default=None),
             "losses": [m["loss"] for m in steps]} if steps else None
    runs = bench.get("runs", {})
    ours = runs.get("packed", {}).get("pairs_per_s")
    summary = {"stages": stages, "matrix_ok": matrix.get("ok"), "torch_varlen_semantics":
               matrix.get("torch_varlen_semantics"), "bf16_guard": matrix.get("bf16_guard"), "train": train,
               "bench": {name: {k: r.get(k) for k in ("attn", "tokens_per_s", "pairs_per_s", "mfu",
                                                      "model_tflops_per_s", "peak_mem_mb", "spread")}
                         for name, r in runs.items()},
               "bench_groups": {name: {k: r.get(k) for k in ("tokens_per_s", "pairs_per_s", "computed_tokens", "spread")}
                                for name, r in bench_groups.get("runs", {}).items()},
               "bench_same_trajectory": bench.get("same_trajectory"),
               "bench_unmeasured": bench.get("unmeasured", []),  # a bench that ended early keeps what it measured
               # a configuration that crashed, named with its error (and the kernel, rerun with CUDA_LAUNCH_BLOCKING=1)
               "bench_failed": {**bench.get("failed", {}), **bench_groups.get("failed", {})},
               "bench_comparisons": bench.get("comparisons", []) + bench_groups.get("comparisons", []),
               "bench_skipped_packing_check": "--skip-packing-check" in json.dumps(bench.get("command", "")),
               "trl": trl_report, "logps": _read_json(out / "logps.json"),
               "profile": _read_json(out / "profile" / "profile.json"),  # the step by category (--profile-steps)
               "tune": (_read_json(out / "tune" / "tune.json") or {}).get("rows"),  # scripts/gpu_tune.py's table
               "ours_over_trl_pairs_per_s": ours / trl_report["pairs_per_s"]
               if ours and trl_report and trl_report.get("pairs_per_s") else None,
               "environment": matrix.get("torch") and {"torch": matrix.get("torch"), "gpu": matrix.get("gpu"),
                                                       "transformers": matrix.get("transformers")}}
    (out / "acceptance.json").write_text(json.dumps(summary, indent=1))
    lines = ["# GPU acceptance", "", "| stage | exit | seconds |", "|---|---|---|"]
    lines += [f"| {s['stage']} | {s['rc']} | {s['seconds']} |" for s in stages]
    profile_table = out / "profile" / "profile.md"  # written by the run beside profile.json
    lines += ["", profile_table.read_text()] if profile_table.is_file() else []
    tune_table = out / "tune" / "tune.md"
    lines += ["", "Levers (the train stage per variant):", "", tune_table.read_text()] if tune_table.is_file() else []
    lines += ["", f"Matrix ok: {matrix.get('ok')}; environment: {summary['environment']}", "",
              "| arch | attn | rows | dtype | logps diff | per token | grad diff / scale | ok |", "|---|---|---|---|---|---|---|---|"]
    for r in matrix.get("matrix", []):
        if r.get("verdict") == "refused":
            lines.append(f"| {r['arch']} | {r['attn']} | | | refused | | | {r['ok']} |")
        elif "error" in r:
            lines.append(f"| {r['arch']} | {r['attn']} | {r.get('rows')} | {r.get('dtype')} | {r['error'][:80]} | | | False |")
        else:
            lines.append(f"| {r['arch']} | {r['attn']} | {r.get('rows')} | {r['dtype']} | {_fmt(r['logps_diff'])} | "
                         f"{_fmt(r['diff_per_token'])} | {_fmt(r['grad_diff'] / max(r['grad_scale'], 1e-30))} | {r['ok']} |")
    guard = matrix.get("bf16_guard") or {}
    lines += ["", f"bf16 guard: worst per token {_fmt(guard.get('worst_per_token'))} against tolerance "
                  f"{guard.get('tolerance_per_token')}", ""]
    for f in guard.get("figures", []):
        lines.append(f"- {f['model']} {f['attn']}: max per token {_fmt(f['max_diff_per_token'])}, longest "
                     f"{f['longest_sequence']}")
    lines += ["", f"torch_varlen semantics: {summary['torch_varlen_semantics']}", ""]
    guard_check = (train_plan or {}).get("packing_check")
    if guard_check:
        lines += [f"Start-up guard of the training run: {guard_check['layout']} rows of {guard_check['attn']} within "
                  f"{_fmt(guard_check['max_diff_per_token'])} per token of eager alone (tolerance "
                  f"{_fmt(guard_check['tolerance_per_token'])}, noise floor {_fmt(guard_check['noise_floor_per_token'])},"
                  f" longest sequence {guard_check['longest_sequence']})", ""]
    if train:  # what ran, from the run's own plan (a smoke run is fp32 on a CPU rank)
        ranks, attention = (train_plan or {}).get("layout", {}), (train_plan or {}).get("attention", {})
        lines += [f"Training ({ranks.get('world_size', '?')} rank, ZeRO-3, {attention.get('dtype', '?')}, "
                  f"{attention.get('backend', '?')}, {train['measured_steps']} measured steps): "
                  f"{_fmt(train['tokens_per_s'], ',.0f')} tokens/s, {_fmt(train['pairs_per_s'], '.3g')} pairs/s, "
                  f"MFU {_fmt(train['mfu'], '.3f')}, peak memory {_fmt(train['peak_memory'], ',.0f')} MB", ""]
    if summary["bench_unmeasured"]:
        lines += [f"**The bench ended early: not measured {', '.join(summary['bench_unmeasured'])}.**", ""]
    for name, failure in summary["bench_failed"].items():
        rerun = failure.get("blocking_rerun") or {}
        lines += [f"**Bench: {name} failed in round {failure['round']}: {failure['error']}** "
                  f"(CUDA_LAUNCH_BLOCKING=1: {rerun.get('error', '-')} at {rerun.get('where') or '-'})", ""]
    lines += [f"- {comparison['name']} ({comparison['numerator']} / {comparison['denominator']}): "
              f"{_fmt(comparison['speedup'])}x, token ideal {_fmt(comparison['ideal_speedup'])}x"
              for comparison in summary["bench_comparisons"]] + [""]
    lines += ["| bench configuration | attn | tokens/s | pairs/s | MFU | peak MB |", "|---|---|---|---|---|---|"]
    for name, r in summary["bench"].items():
        lines.append(f"| {name} | {r['attn']} | {_fmt(r['tokens_per_s'], ',.0f')} | {_fmt(r['pairs_per_s'])} | "
                     f"{_fmt(r['mfu'], '.3f')} | {_fmt(r['peak_mem_mb'], ',.0f')} |")
    if trl_report:
        lines += ["", f"TRL {trl_report['trl']} DPOTrainer: {_fmt(trl_report['pairs_per_s'])} pairs/s "
                      f"(peak {_fmt(trl_report['peak_memory_gib'], '.1f')} GiB); ours (packed) / TRL: "
                      f"{_fmt(summary['ours_over_trl_pairs_per_s'])}"]
    (out / "acceptance.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("setup")
    p.add_argument("work", type=Path)
    shapes = p.add_mutually_exclusive_group()
    shapes.add_argument("--smoke", action="store_true")
    shapes.add_argument("--bench-model", action="store_true")
    p = sub.add_parser("trl")
    p.add_argument("work", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-pairs", type=int, default=32)
    p.add_argument("--micro-batch-pairs", type=int, default=4)
    p.add_argument("--max-length", type=int, default=4096)
    p = sub.add_parser("summarize")
    p.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "setup":
        setup(args.work, args.smoke, args.bench_model)
    elif args.command == "trl":
        trl_baseline(args.work, args.out, args.steps, args.batch_pairs, args.micro_batch_pairs, args.max_length)
    else:
        return summarize(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
