"""Rank 0's outputs of a training run: the run files, metrics.jsonl, the progress bar and DeepSpeed's monitors.

Every optimizer step becomes one JSON line, flushed at once (a crash loses at most
the step in flight), one update of the tqdm bar and one batch of DeepSpeed monitor
events (tensorboard, csv, wandb, comet: whichever the DeepSpeed config enables).  A step
after which the run evaluated carries the ``eval_*`` figures in the same record.
On resume the metrics file is continued after dropping the records of the steps the
resume redoes.  Other ranks write nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..config import to_dict
from .checkpoint import trim_metrics


def add_sums(sums: dict, row_sums: dict, weight: float) -> None:
    """Adds one row's sums (tensors) into ``sums``, in fp64 (a step's sums then do not depend on how its rows were
    cut), times ``weight`` (0 on the ranks of a sequence-parallel group that do not count metrics)."""
    for key, value in row_sums.items():
        sums[key] = sums.get(key, 0.0) + value.detach().double() * weight


def step_figures(record: dict) -> str:
    """A step's main figures in a few words (the --no-progress line)."""
    figures = (f"loss {record['loss']:.4f}, acc {record['rewards/accuracies']:.2f}, lr {record['learning_rate']:.3g}, "
               f"grad norm {record['grad_norm']:.3g}, {record['tokens_per_s']:.0f} tokens/s")
    if "eval_loss" in record:
        figures += f", eval loss {record['eval_loss']:.4f}"
    return figures


def sum_over_ranks(sums: dict, device) -> dict[str, float]:
    """The sums of every rank, in one all-reduce for all keys (every rank passes the same keys)."""
    keys = sorted(sums)
    packed = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64, device=device).reshape(()) for k in keys])
    dist.all_reduce(packed)
    return dict(zip(keys, packed.tolist()))


class MetricsWriter:
    def __init__(self, run, total_steps: int, done_steps: int, resumed: bool, plan_summary: dict):
        cfg = run.setup.cfg
        self.policy = run.policy
        self.enabled = run.setup.layout.rank == 0
        self.file = None
        self.eval_figures: dict[str, str] = {}  # the latest evaluation's, shown on the bar until the next one
        self.total_steps = total_steps
        self.line_every = None if cfg.progress else cfg.logging_steps  # --no-progress: a line every N steps
        self.metrics_path = cfg.resolved_metrics_out
        self.bar = tqdm(total=total_steps, initial=min(done_steps, total_steps), desc="dpo", unit="step",
                        dynamic_ncols=True, disable=not (self.enabled and cfg.progress))
        if not self.enabled:
            return
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "run_config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
        (out / "data_summary.json").write_text(json.dumps(run.setup.prepared.summary, indent=2) + "\n")
        (out / "plan_summary.json").write_text(json.dumps(plan_summary, indent=2) + "\n")
        path = Path(cfg.resolved_metrics_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        if resumed:
            trim_metrics(path, done_steps)  # records of steps the resume undoes
        self.file = open(path, "a" if resumed else "w")

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self._monitor(record)
        if "eval_loss" in record:
            self.eval_figures = {"eval_loss": f"{record['eval_loss']:.4f}",
                                 "eval_acc": f"{record['eval_rewards/accuracies']:.2f}"}
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", acc=f"{record['rewards/accuracies']:.2f}",
                             tok_s=f"{record['tokens_per_s']:.0f}", **self.eval_figures, refresh=False)
        self.bar.update(1)
        step = record["step"]
        if self.line_every and (step % self.line_every == 0 or step == self.total_steps):
            print(f"step {step}/{self.total_steps}: {step_figures(record)}", flush=True)

    def finish(self, history: list[dict]) -> None:
        """The run's last line: its steps, how the loss went, its throughput and where the metrics are."""
        if not self.enabled or not history:
            return
        self.bar.close()
        seconds = sum(r["step_time_s"] for r in history)
        tokens = sum(r["tokens"] for r in history)
        print(f"done: {len(history)} steps (to step {history[-1]['step']}) in {seconds:.1f} s, loss "
              f"{history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}, {tokens / seconds:.0f} tokens/s; metrics in "
              f"{self.metrics_path}", flush=True)

    def _monitor(self, record: dict) -> None:
        """Hands the step's figures to DeepSpeed's monitors as ``Train/<name>``.

        They are indexed like DeepSpeed's own events (its ``Train/Samples/lr``, written inside
        ``engine.step()``): by the engine's ``global_samples`` (here the data-parallel size
        times the optimizer step).  With the optimizer step as index, behind DeepSpeed's on 2+
        ranks, wandb would drop every one of them (its steps must never go back).
        ``Train/step`` maps the index to the step.
        """
        monitor = getattr(self.policy, "monitor", None)
        if monitor is not None and getattr(monitor, "enabled", False):
            index = self.policy.global_samples
            monitor.write_events([(f"Train/{k}", v, index) for k, v in record.items()
                                  if isinstance(v, (int, float)) and math.isfinite(v)])

    def close(self) -> None:
        self.bar.close()
        if self.file is not None:
            self.file.close()
