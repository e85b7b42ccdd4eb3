"""The training loop: every rank runs exactly the rows the plan deals its data-parallel share.

Per optimizer step each rank runs the same number K of rows (the plan guarantees it;
ZeRO-3 hangs otherwise).  The loss of a row is its pairs' loss sum divided by the
step's global pair count times the count DeepSpeed divides the summed gradients by
(``ParallelLayout.gradient_divisor``), so DeepSpeed's gradient average equals the
gradient of the mean over all pairs of the step, whatever the layout.  With prompt groups spread
over ranks a row holds no whole pair: every rank's row i carries the loss of all the pairs of row
slot i, its own responses' sums with their graph and the others' exchanged (``response_exchange``),
so each rank's gradient is its responses' share and their sum the one-rank gradient; the pairs'
figures are counted once (rank 0).  The
accumulation boundary is set by hand because K changes from step to step.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..data.run_plan import plan_figures, run_plan
from ..errors import PeerFailureError, RunAbortedError, TooManyBadStepsError, first_line
from ..model.losses import global_normalized_loss, metric_means, metric_sums, pair_losses
from . import hooks, stop
from .assemble import Run, RunSetup
from .checkpoint import Checkpointer, ResumePoint, tag_name
from .evaluation import evaluate
from .export import export_checkpoint
from .layout import describe_sizes
from .metrics import MetricsWriter, add_sums, sum_over_ranks
from .process_group import close_process_group, is_collective_failure, lost_peers
from .profile_categories import OPTIMIZER_SCOPE
from .reference_sync import ReferenceSync
from .schedule import Schedule
from .response_exchange import step_rows
from .step_profiler import StepProfiler
from .timing import StepTimer, peak_memory_mb, throughput_meter

STEP_SUM_KEYS = ("loss_sum", "real_tokens", "computed_tokens", "prompt_tokens_shared")
logger = logging.getLogger("ds_packdpo")


class DPOTrainer:
    """Runs the plan on an assembled run's engines and reports one metrics record per optimizer step."""

    def __init__(self, run: Run):
        self.run = run
        self.spec = run.setup.spec
        self.layout = self.spec.layout
        self.policy = run.policy
        self.device = run.device
        self.hooks = hooks.installed()

    def _skip_if_any_rank_bad(self, loss, bad):
        """Makes a step with a non-finite loss on any rank a step DeepSpeed skips, on every rank alike.

        ZeRO's ``step()`` discards a step whose global gradient norm is inf/NaN (the
        norm is all-reduced, so every rank decides the same; ``was_step_applied()``
        then says False).  A loss can be non-finite while the gradients are not (a
        reference log-prob of -inf), so the loss flag is all-reduced here and such a
        step's gradient made NaN on every rank, which routes it into the same skip.
        """
        flag = bad.float().reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return loss * float("nan") if flag.item() > 0 else loss

    def train_step(self, plan, step: int = 0) -> dict:
        """Optimizer step ``step`` (1-based; a step hook may act on it) over this rank's rows; returns the metrics of
        the whole step (all ranks)."""
        rows = plan.ranks[self.layout.dp_rank]
        sums: dict[str, torch.Tensor] = {}
        bad = torch.zeros((), dtype=torch.bool, device=self.device)
        lr = self.policy.get_lr()[0] if self.policy.get_lr() else self.spec.optimizer.lr
        batches = [self.run.row_batch(row, plan) for row in rows]
        own_rows = step_rows(self.run, plan, batches)  # rows of whole pairs, or of responses spread over ranks
        for i, batch in enumerate(batches):
            ref = own_rows.reference_logps(i)
            self.policy.set_gradient_accumulation_boundary(i == len(rows) - 1)
            pol = self.run.forward_logps(self.policy, batch)
            pol, ref, partners = own_rows.pair_logps(i, pol, ref)  # the pairs whose loss this row's backward carries
            losses, per_pair = pair_losses(pol, ref, self.spec.loss, partners)
            losses = self.hooks.losses(step, losses)
            bad |= ~torch.isfinite(losses.detach()).all()
            loss = global_normalized_loss(losses, plan.num_pairs, self.layout.gradient_divisor)
            if i == len(rows) - 1:
                loss = self._skip_if_any_rank_bad(loss, bad)
            self.policy.backward(loss, scale_wrt_gas=False)
            with record_function(OPTIMIZER_SCOPE):  # the update itself at the boundary (the step profile's category)
                self.policy.step()
            row_sums = metric_sums(per_pair, pol)
            row_sums["loss_sum"] = losses.detach().sum()
            add_sums(sums, row_sums, own_rows.pair_weight)
            add_sums(sums, {key: torch.tensor(value, dtype=torch.float64, device=self.device)
                            for key, value in own_rows.token_sums(i).items()}, 1.0)
        totals = sum_over_ranks(sums, self.device)  # one collective per step for every metric
        metrics = metric_means({k: v for k, v in totals.items() if k not in STEP_SUM_KEYS})
        grad_norm = self.policy.get_global_grad_norm()
        metrics.update({
            "loss": totals["loss_sum"] / max(totals["pairs"], 1.0),
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "learning_rate": float(lr),
            "skipped": not self.policy.was_step_applied(),
            "pairs": int(round(totals["pairs"])),
            "tokens": int(round(totals["real_tokens"])),
            "computed_tokens": int(round(totals["computed_tokens"])),
            "prompt_tokens_shared": int(round(totals["prompt_tokens_shared"])),
            "rows_per_rank": len(rows),
            **({"prompt_copy_tokens": plan.prompt_copy_tokens} if self.spec.row_layout.groups_prompts else {}),
            "max_rank_tokens": max(plan.rank_tokens),
            "mean_rank_tokens": sum(plan.rank_tokens) / len(plan.rank_tokens),
        })
        return metrics


def engine_settings(engine) -> dict:
    """The settings read back from the engine that runs them (the first record of a run reports them, to be compared
    with run_config.json): its precision, the optimizer's class, the decayed group's weight decay (biases, norms and
    embeddings get none), Adam's betas and eps, DeepSpeed's gradient clipping."""
    groups = engine.optimizer.param_groups
    settings = {"dtype": "bf16" if engine.bfloat16_enabled() else "fp32",
                "optimizer": type(engine.basic_optimizer).__name__,
                "weight_decay": max(group.get("weight_decay", 0.0) for group in groups),
                "max_grad_norm": float(engine.gradient_clipping())}
    if "betas" in groups[0]:
        settings["adam_betas"] = [float(beta) for beta in groups[0]["betas"]]
    if "eps" in groups[0]:
        settings["adam_epsilon"] = float(groups[0]["eps"])
    return settings


def plan_summary(setup: RunSetup) -> dict:
    """What the run will do, known before its first step: its pairs, steps, forwards per rank, lock-step utilization,
    held-out pairs and LR schedule (the first line a run prints, and OUTPUT_DIR/plan_summary.json)."""
    spec, schedule = setup.spec, setup.schedule
    figures = plan_figures(spec.plan.config, setup.prepared, setup.length.epochs, schedule.total_steps)
    held_out = setup.held_out.pairs.chosen_lengths.size if setup.held_out else 0
    row_layout = spec.plan.config.layout
    return {"pairs": figures["pairs"], "train_pairs": int(setup.prepared.chosen_lengths.size),
            "steps": schedule.total_steps, "layout": spec.layout.as_dict(),
            "attention": {"backend": spec.attention.backend, "dtype": spec.model.dtype,
                          "prefix_sharing": row_layout.shares_prefixes, "prompt_groups": row_layout.groups_prompts},
            **figures, "eval_pairs": held_out, "eval_steps": spec.evaluation.steps if held_out else None,
            "schedule": dataclasses.asdict(schedule), "deepspeed_scheduler": setup.ds_config.get("scheduler"),
            "epochs": setup.length.epochs,
            "max_steps_capped": ({"max_steps": spec.plan.max_steps, "epochs": spec.plan.epochs}
                                 if setup.length.capped_at is not None else None)}


def describe_attention(attention: dict) -> str:
    """The backend that runs, in the plan line: ``attention torch_varlen bf16 with prefix sharing``."""
    sharing = "with" if attention["prefix_sharing"] else "without"
    groups = " and prompt groups" if attention.get("prompt_groups") else ""
    return f"attention {attention['backend']} {attention['dtype']} {sharing} prefix sharing{groups}"


def describe_plan(summary: dict) -> str:
    """The plan summary in one line."""
    fewest, most = summary["rows_per_rank"]["min"], summary["rows_per_rank"]["max"]
    rows = f"{most} row{'' if most == 1 else 's'}" if fewest == most else f"{fewest}-{most} rows"
    if summary["eval_pairs"]:
        every = f"every {summary['eval_steps']} steps and " if summary["eval_steps"] else ""
        held_out = f"; eval on {summary['eval_pairs']} held-out pairs {every}at the end"
    else:
        held_out = "; no evaluation"
    per_step = summary.get("pairs_per_step", {"min": 0, "max": 0})
    varying = (f" ({per_step['min']}-{per_step['max']} pairs per step: whole prompt groups)"
               if per_step["min"] != per_step["max"] else "")
    capped = summary.get("max_steps_capped")
    cap = (f" (--epochs {capped['epochs']} holds only these of --max-steps {capped['max_steps']}; leave --epochs out "
           f"to run them all)" if capped else "")
    return (f"plan: {summary['pairs']} pairs in {summary['steps']} steps{varying}{cap} ({summary['train_pairs']} "
            f"training pairs), "
            f"{rows} per rank on {describe_sizes(summary['layout'])}, {describe_attention(summary['attention'])}, "
            f"lock-step utilization {summary['lockstep_utilization']:.3f}{describe_copies(summary)}{held_out}; "
            f"schedule: {Schedule(**summary['schedule']).describe()}")


def describe_copies(summary: dict) -> str:
    """The tokens prompt groups spend on balance, beside the lock-step utilization they buy (nothing without them)."""
    if "prompt_copy_tokens" not in summary:
        return ""
    return (f" with {summary['prompt_copy_tokens']:,} prompt tokens copied to spread groups over ranks "
            f"({summary['prompt_copy_tokens'] / max(summary['tokens'], 1):.1%} of the tokens)")


def export_on_end(setup: RunSetup) -> None:
    """--export-on-end (rank 0, once the process group is closed): OUTPUT_DIR/hf_model from the final checkpoint's
    fp32 master weights, cast to --dtype, in safetensors files of at most --max-shard-size.

    Going through the checkpoint (the loop saves the last step) reuses the offline export
    and is exact in any dtype; gathering the engine's 16-bit weights would give the
    module's copy, which in bf16 training is not the fp32 master.  Offline, after the
    other ranks have gone: the export may outlast --collective-timeout-s.
    """
    checkpoint = setup.spec.checkpoint
    # the latest checkpoint is the final one; a resumed run may replace the export of its own earlier attempt
    export_checkpoint(checkpoint.save_dir, checkpoint.export_dir, setup.spec.model.dtype,
                      overwrite=setup.spec.outputs.overwrite or setup.resume is not None,
                      max_shard_size=checkpoint.max_shard_size)


def describe_resume(point: ResumePoint) -> str:
    """The line a resumed run starts with: the checkpoint it loaded, and the newer ones it passed over and why."""
    passed = f" (passed over {'; '.join(point.skipped)})" if point.skipped else ""
    return f"resuming from {point.tag_dir} at step {point.global_step}{passed}"


def train_loop(run: Run, summary: dict) -> list[dict]:
    """The steps of an assembled training run on this rank; returns the per-step metrics (rank 0 also writes them)."""
    setup, spec = run.setup, run.setup.spec
    trainer = DPOTrainer(run)
    reference_sync = ReferenceSync.of(run)  # --sync-ref-model (TR-DPO); None otherwise
    checkpointer = Checkpointer(run, reference_sync)
    resume = setup.resume
    if resume is not None:
        checkpointer.restore(run.policy, resume)
        if spec.layout.rank == 0:
            print(describe_resume(resume), file=sys.stderr, flush=True)
    steps = setup.schedule.total_steps
    start = resume or ResumePoint(None, epoch=0, epoch_step=0, global_step=0, bad_steps=0)
    meter = throughput_meter(run) if spec.device_type == "cuda" else None
    if summary:  # rank 0: the start-up guard's figures beside the plan (measured, so not in the plan line)
        summary = {**summary, "packing_check": run.packing_check}
    writer = MetricsWriter(run, steps, start.global_step, resumed=resume is not None, plan_summary=summary)
    history = []
    timer = StepTimer()
    profiler = StepProfiler(spec.outputs.profile_steps or 0, steps, start.global_step, spec.device_type,
                            spec.outputs.profile_path if spec.layout.rank == 0 else None)
    global_step, bad_steps = start.global_step, start.bad_steps
    position = (start.epoch, start.epoch_step)  # plan position of the next step
    plans = run_plan(setup.prepared, spec.plan.config, setup.length.epochs, start_epoch=start.epoch,
                     start_step=start.epoch_step)
    stop.install()  # from here a SIGTERM/SIGINT stops at a step boundary, saved; before, it ends the rank at once
    try:
        for plan in plans:  # collectives here fail fast on a dead peer, after --collective-timeout-s on a stalled one
            if global_step >= steps:
                break
            undo = trainer.hooks.step_begins(run, global_step + 1)
            profiler.begin(global_step + 1)
            timer.begin()
            with profiler.range():
                metrics = trainer.train_step(plan, global_step + 1)
            undo()
            seconds = timer.seconds()
            profiler.end(global_step + 1)
            global_step += 1
            if reference_sync is not None:  # on schedule, skipped steps included (TRL's on_step_end), before eval/save
                reference_sync.after_step(global_step)
            position = (plan.epoch, plan.step + 1)
            bad_steps = bad_steps + 1 if metrics["skipped"] else 0
            record = {"step": global_step, "epoch": plan.epoch, "epoch_step": plan.step, **metrics,
                      "step_time_s": seconds, "tokens_per_s": metrics["tokens"] / seconds,
                      "pairs_per_s": metrics["pairs"] / seconds, "peak_mem_mb": peak_memory_mb(spec.device_type)}
            if meter is not None:
                record.update(meter.figures(meter.step_flops(plan), seconds))
            if setup.held_out is not None and spec.evaluation.due(global_step, last=global_step >= steps):
                record.update(evaluate(run))
            if not history:  # this process's first step: what the engine ran with
                record.update(engine_settings(run.policy))
            history.append(record)
            if writer.enabled and metrics["skipped"]:
                logger.warning(f"step {global_step} skipped: non-finite loss or gradient "
                               f"({bad_steps} in a row, --max-bad-steps {spec.checkpoint.max_bad_steps})")
            writer.write(record)
            if bad_steps >= spec.checkpoint.max_bad_steps:
                raise TooManyBadStepsError(f"{bad_steps} consecutive steps (up to step {global_step}) had a non-finite "
                                           f"loss or gradient (--max-bad-steps {spec.checkpoint.max_bad_steps}); "
                                           f"aborting")
            if checkpointer.due(global_step, last=global_step >= steps):
                checkpointer.save(run.policy, global_step, *position, bad_steps)
            if stop.agreed(run.device) and global_step < steps:  # every rank alike, at this step boundary
                raise stop_here(checkpointer, run, global_step, position, bad_steps)
        if spec.checkpoint.export_on_end and checkpointer.saved_step != global_step:  # the checkpoint the export reads
            checkpointer.save(run.policy, global_step, *position, bad_steps)
        writer.finish(history)
    except RuntimeError as error:
        if isinstance(error, RunAbortedError) or not is_collective_failure(error):
            raise
        raise PeerFailureError(
            f"rank {spec.layout.rank}: a collective failed after step {global_step}: {lost_peers()} "
            f"longer than --collective-timeout-s {spec.collective_timeout_s:g}; relaunch with --resume auto to continue "
            f"from the last complete checkpoint ({first_line(error)})") from error
    finally:
        writer.close()
    return history


def stop_here(checkpointer: Checkpointer, run: Run, global_step: int, position: tuple[int, int],
              bad_steps: int) -> Exception:
    """A stop every rank agreed on after ``global_step``: its checkpoint (unless this step's is saved already, or
    nothing is to be saved), the process group closed, and the error each rank exits with (code 7)."""
    if run.setup.spec.checkpoint.saves_on_stop and checkpointer.saved_step != global_step:
        checkpointer.save(run.policy, global_step, *position, bad_steps)
    close_process_group()
    tag = tag_name(checkpointer.saved_step) if checkpointer.saved_step is not None else None
    return stop.stopped(global_step, tag, run.setup.spec.layout.rank)

