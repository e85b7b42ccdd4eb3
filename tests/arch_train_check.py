"""One rank of the architecture-matrix training check (launched by tests/test_architectures.py).

Every architecture of ``model.build.ARCHITECTURES`` in turn, in one process group: its model folder (saved by
rank 0: random weights, the embedded data's tokenizer) is trained by the real assembly and loop
(``assemble`` + ``train_loop``: ZeRO-3, --attn auto, the start-up guard) for one optimizer step, tiny Mistral and
Gemma 3 for three.  For those two, rank 0 then recomputes the pairs of step 1 from the saved weights without
DeepSpeed, each sequence alone with eager attention, and reports how far the step-1 log-prob means of the
training run are from them.  Rank 0 writes one JSON report.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ds_packdpo.config import parse_train_args
from ds_packdpo.data.run_plan import run_plan
from ds_packdpo.data.synthetic import default_tokenizer, synthetic_preference_rows
from ds_packdpo.model.build import ARCHITECTURES, build_model
from ds_packdpo.model.collate import collate_padded
from ds_packdpo.model.guard import each_sequence_alone
from ds_packdpo.run.assemble import prepare, start
from ds_packdpo.run.process_group import close_process_group, init_process_group
from ds_packdpo.run.layout import ParallelLayout
from ds_packdpo.run.trainer import plan_summary, train_loop

PAIRS = 24  # at --max-length 40 the cut prompts repeat: steps of whole prompt groups, 3 of them from 24 pairs
THREE_STEPS = ("mistral", "gemma3")
FLAGS = ["--synthetic-pairs", str(PAIRS), "--global-batch-pairs", "4", "--max-length", "40", "--lr", "1e-3",
         "--attn", "auto", "--dtype", "auto", "--no-progress", "--overwrite"]


def save_models(workdir: Path) -> None:
    tokenizer = default_tokenizer(synthetic_preference_rows(PAIRS, seed=0))
    for arch in ARCHITECTURES:
        folder = workdir / arch / "model"
        # a few spare ids: loaded beside a Qwen2 config.json, transformers gives this tokenizer one more token
        model = build_model(None, f"tiny-{arch}", len(tokenizer) + 8, torch.float32, "eager", seed=0)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)


def step1_eager_means(run, folder: Path) -> tuple[float, float, int]:
    """Mean chosen and rejected log-prob of step 1's pairs, each sequence alone with eager attention, no DeepSpeed;
    and the longest sequence."""
    setup = run.setup
    plan = next(iter(run_plan(setup.prepared, setup.spec.plan.config, 1)))
    indices = sorted(plan.pairs)
    columns = setup.prepared.dataset.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"]).to_list()
    model = build_model(str(folder), None, setup.vocab_size, torch.float32, "eager").eval()
    padded = collate_padded([columns[i] for i in indices], indices, setup.pad_token_id)
    with torch.no_grad():
        logps = each_sequence_alone(model, padded)
    return float(logps[0::2].mean()), float(logps[1::2].mean()), int(padded.attention_mask.sum(dim=1).max())


def main(workdir: str, out_path: str) -> None:
    workdir = Path(workdir)
    # tiny models: one thread per rank (two ranks share two cores; oversubscribed threads made every step ~10x slower)
    torch.set_num_threads(1)
    layout = ParallelLayout.from_launch(1, 3)
    init_process_group(layout, 300.0)
    if dist.get_rank() == 0:
        save_models(workdir)
    dist.barrier()
    report = {}
    for arch in ARCHITECTURES:
        folder = workdir / arch / "model"
        steps = 3 if arch in THREE_STEPS else 1
        started = time.perf_counter()
        cfg = parse_train_args(["--model", str(folder), "--output-dir", str(workdir / arch / "run"), "--cache-dir",
                                str(workdir / "cache"), "--max-steps", str(steps), *FLAGS])
        setup = prepare(cfg, "train")
        run = start(setup)
        history = train_loop(run, plan_summary(setup))
        result = {"attn": run.setup.spec.attention.backend, "guard": run.packing_check,
                  "metrics": [{k: s[k] for k in ("loss", "grad_norm", "logps/chosen", "logps/rejected")}
                              for s in history]}
        if arch in THREE_STEPS and dist.get_rank() == 0:
            chosen, rejected, longest = step1_eager_means(run, folder)
            first = history[0]
            result.update(longest=longest, step1_logps_scale=max(abs(chosen), abs(rejected)),
                          step1_logps_diff=[abs(first["logps/chosen"] - chosen),
                                            abs(first["logps/rejected"] - rejected)])
        run.close()
        report[arch] = {**result, "seconds": round(time.perf_counter() - started, 1)}
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(report, indent=1))
    dist.barrier()
    close_process_group()


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
