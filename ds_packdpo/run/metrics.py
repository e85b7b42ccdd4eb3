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
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..errors import InputError
from ..files import atomic_write

# --report-to's names -> the DeepSpeed config's monitor sections
MONITORS = {"tensorboard": "tensorboard", "wandb": "wandb", "csv": "csv_monitor", "comet": "comet"}


@dataclass(frozen=True)
class OutputSpec:
    """What a run shows and writes besides its checkpoints: the run folder and its files, the step log, the progress
    bars, DeepSpeed's monitors, the libraries' noise."""

    output_dir: Path
    metrics_path: Path  # --metrics-out, default OUTPUT_DIR/metrics.jsonl
    overwrite: bool  # may write into a non-empty run folder
    progress: bool  # rank 0's bars (--no-progress: a line every logging_steps steps instead)
    logging_steps: int
    verbose: bool  # the libraries' warnings and DeepSpeed's INFO lines
    monitors: tuple[str, ...]  # --report-to, each once, in order
    run_name: str  # --run-name, default the run folder's name
    project: str | None  # the wandb or comet project
    peak_tflops: float | None  # one device's peak, for MFU
    profile_steps: int | None = None  # steps under torch.profiler, OUTPUT_DIR/profile.json (run/step_profiler.py)

    @property
    def profile_path(self) -> Path:
        return self.output_dir / "profile.json"

    def __post_init__(self):
        unknown = sorted(set(self.monitors) - set(MONITORS))
        if unknown:
            raise InputError(f"--report-to: {', '.join(unknown)} is not one of {', '.join(MONITORS)}")
        if self.project is not None and not {"wandb", "comet"} & set(self.monitors):
            raise InputError(f"--project {self.project} names a wandb or comet project: add --report-to wandb or comet")


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


LOSS_WINDOW = 10  # steps averaged at each end of the done: line's loss change


def loss_change(history: list[dict]) -> str:
    """How the loss went over this run's steps, said with what it compares: the mean of the first and of the last
    window of up to :data:`LOSS_WINDOW` steps (half the run at most: the two never overlap).  One step's loss against
    another's read as a regression whenever the last step's batch was a hard one (a resume's 0.2395 -> 0.4699)."""
    window = max(1, min(LOSS_WINDOW, len(history) // 2))
    first, last = history[:window], history[-window:]

    def mean(records: list[dict]) -> float:
        losses = [r["loss"] for r in records if math.isfinite(r["loss"])]  # a skipped bad step's is not
        return math.fsum(losses) / len(losses) if losses else math.nan

    def steps(records: list[dict]) -> str:
        return f"step {records[0]['step']}" if len(records) == 1 else f"steps {records[0]['step']}-{records[-1]['step']}"

    if len(history) == 1:
        return f"loss {mean(history):.4f} (step {history[0]['step']})"
    what = "" if window == 1 else "mean of "
    return f"loss {mean(first):.4f} -> {mean(last):.4f} ({what}{steps(first)} -> {steps(last)})"


class MetricsWriter:
    def __init__(self, run, total_steps: int, done_steps: int, resumed: bool, plan_summary: dict):
        outputs = run.setup.spec.outputs
        self.policy = run.policy
        self.enabled = run.setup.spec.layout.rank == 0
        self.file = None
        self.eval_figures: dict[str, str] = {}  # the latest evaluation's, shown on the bar until the next one
        self.total_steps = total_steps
        self.line_every = None if outputs.progress else outputs.logging_steps  # --no-progress: a line every N steps
        self.metrics_path = outputs.metrics_path
        self.bar = tqdm(total=total_steps, initial=min(done_steps, total_steps), desc="dpo", unit="step",
                        dynamic_ncols=True, disable=not (self.enabled and outputs.progress))
        if not self.enabled:
            return
        out = outputs.output_dir
        out.mkdir(parents=True, exist_ok=True)
        (out / "run_config.json").write_text(json.dumps(run.setup.spec.settings, indent=2) + "\n")
        (out / "data_summary.json").write_text(json.dumps(run.setup.prepared.summary, indent=2) + "\n")
        (out / "plan_summary.json").write_text(json.dumps(plan_summary, indent=2) + "\n")
        path = outputs.metrics_path
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
        print(f"done: {len(history)} steps (to step {history[-1]['step']}) in {seconds:.1f} s, {loss_change(history)}, "
              f"{tokens / seconds:.0f} tokens/s; metrics in {self.metrics_path}", flush=True)

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


def trim_metrics(path: Path, global_step: int) -> int:
    """On resume: keep the records of steps <= ``global_step`` (later ones were undone); returns how many were cut."""
    if not path.is_file():
        return 0
    def kept_step(line: str) -> bool:
        try:
            return json.loads(line)["step"] <= global_step
        except (json.JSONDecodeError, KeyError, TypeError):
            return False  # a line torn by the crash

    lines = path.read_text().splitlines()
    kept = [line for line in lines if kept_step(line)]
    if len(kept) < len(lines):
        atomic_write(path, lambda temporary: Path(temporary).write_text("".join(line + "\n" for line in kept)))
    return len(lines) - len(kept)
