"""The training loop: every rank runs exactly the rows the plan deals it.

The run has two phases.  Everything that can fail because of the user's input
(settings, DeepSpeed config, model folder, dataset rows, a pair over the row
budget) runs first, with no process group, so it ends in a one-line error on
every rank before anything heavy starts.  Only then are the process group and
the engines built.

Per optimizer step each rank runs the same number K of rows (the plan
guarantees it; ZeRO-3 hangs otherwise).  The loss of a row is its pairs' loss
sum divided by the step's global pair count times the number of ranks DeepSpeed
divides the summed gradients by (the data-parallel size; the whole world under
ZeRO-3 with sequence parallelism), so DeepSpeed's gradient average equals the
gradient of the mean over all pairs of the step, whatever the layout.  The
accumulation boundary is set by hand because K changes from step to step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from ..config import TrainConfig, to_dict
from ..errors import InputError, PeerFailureError, RunAbortedError, TooManyBadStepsError

STEP_SUM_KEYS = ("loss_sum", "real_tokens", "computed_tokens")
logger = logging.getLogger("ds_packdpo")


def _is_collective_failure(error: RuntimeError) -> bool:
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or any(key in text for key in ("gloo", "NCCL", "c10d"))


@dataclass
class PreparedRun:
    """What phase one hands to phase two: validated settings, data and plan settings."""

    cfg: TrainConfig
    attn: str
    device_type: str
    world_size: int
    ds_config: dict
    tokenizer: object
    prepared: object
    plan_cfg: object
    loss_cfg: object
    resume: object = None  # checkpoint.ResumePoint, or None for a fresh start

    @property
    def model_attn(self) -> str:
        """The model's attn_implementation: Ulysses (around ``attn``) under sequence parallelism."""
        from ..model.attention import ULYSSES_ATTN

        return ULYSSES_ATTN if self.cfg.sequence_parallel_size > 1 else self.attn

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0


def _tokenizer_and_rows(cfg: TrainConfig):
    from ..data.synthetic import default_tokenizer, synthetic_preference_rows
    from ..data.tokenizer import load_tokenizer

    rows = None
    if cfg.dataset is None:
        rows = synthetic_preference_rows(cfg.synthetic_pairs, seed=0)
    if cfg.tokenizer is not None or cfg.model is not None:
        tokenizer = load_tokenizer(cfg.tokenizer or cfg.model, trust_remote_code=cfg.trust_remote_code)
    elif rows is not None:
        tokenizer = default_tokenizer(rows)
    else:
        raise InputError("--tokenizer is required with --dataset when no --model folder provides one")
    return tokenizer, rows


def prepare_data(cfg: TrainConfig, tokenizer, rows):
    """Tokenizes once per node: the first rank to take the lock builds the cache, the others then read it."""
    from filelock import FileLock

    from ..data.prepare import DEFAULT_CACHE_DIR, DataConfig, prepare_pairs

    cache_dir = Path(os.path.expanduser(cfg.cache_dir or DEFAULT_CACHE_DIR))
    cache_dir.mkdir(parents=True, exist_ok=True)
    data_cfg = DataConfig.from_settings(cfg, dataset=cfg.dataset or "synthetic", cache_dir=str(cache_dir))
    with FileLock(str(cache_dir / "prepare.lock")):
        return prepare_pairs(data_cfg, tokenizer, rows=rows)


def check_output_dir(cfg: TrainConfig) -> None:
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"--output-dir {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not cfg.overwrite:
        from .checkpoint import resumes_in_place

        if not resumes_in_place(cfg):  # a resumed run continues in its own folder
            if cfg.resume:
                raise InputError(f"--output-dir {out}: folder is not empty and holds no checkpoint of this run to "
                                 "resume; pass --overwrite to write into it")
            raise InputError(f"--output-dir {out}: folder is not empty (pass --overwrite to write into it, or "
                             "--resume auto to continue the run saved there)")


def prepare_run(cfg: TrainConfig, world_size: int | None = None) -> PreparedRun:
    """Phase one: every check that needs no process group (``world_size``: the launch's, when not yet launched)."""
    from deepspeed.accelerator import get_accelerator

    from ..model.attention import resolve_attn
    from .checkpoint import check_resume
    from .engines import fill_ds_config, launch_world_size, load_ds_config, model_hidden_size, zero_stage
    from ..model.losses import LossConfig
    from ..data.plan import PlanConfig, validate_lengths, warn_if_ranks_idle

    device_type = get_accelerator().device_name()
    attn = resolve_attn(cfg.attn, device_type)
    loss_cfg = LossConfig(loss_type=cfg.loss, beta=cfg.beta, label_smoothing=cfg.label_smoothing,
                          simpo_gamma=cfg.simpo_gamma, rpo_alpha=cfg.rpo_alpha)
    loss_cfg.validate()
    world_size = world_size or launch_world_size()
    raw_ds, ds_source = load_ds_config(cfg.ds_config)
    check_output_dir(cfg)
    tokenizer, rows = _tokenizer_and_rows(cfg)
    dp_world_size = check_sequence_parallel_settings(cfg, world_size, attn, len(tokenizer))
    ds_config = fill_ds_config(raw_ds, ds_source, cfg, dp_world_size, model_hidden_size(cfg, len(tokenizer)),
                               device_type)
    # Under sequence parallelism a row is shared by the S ranks of a group: S x the per-rank budget.
    plan_cfg = PlanConfig(max_tokens_per_row=cfg.row_budget * cfg.sequence_parallel_size,
                          world_size=dp_world_size, seed=cfg.seed,
                          global_batch_pairs=cfg.batch_pairs, tokens_per_step=cfg.tokens_per_step,
                          drop_last=cfg.drop_last, attention_weight=cfg.attention_weight,
                          packing=cfg.packing, micro_batch_pairs=cfg.micro_batch_pairs)
    prepared = prepare_data(cfg, tokenizer, rows)
    if len(prepared.chosen_lengths) == 0:
        raise InputError(f"--dataset {cfg.dataset or 'synthetic'}: no pairs left after validation and truncation")
    if cfg.sequence_parallel_size > 1:
        from .sequence_parallel import check_pairs_fit

        check_pairs_fit(prepared.chosen_lengths, prepared.rejected_lengths, cfg.row_budget,
                        cfg.sequence_parallel_size, prepared.dataset["pair_id"])
    validate_lengths(prepared.chosen_lengths, prepared.rejected_lengths, plan_cfg,
                     pair_ids=prepared.dataset["pair_id"])
    warn_if_ranks_idle(len(prepared.chosen_lengths), plan_cfg)
    resume = check_resume(cfg, prepared.fingerprint, world_size, zero_stage(ds_config))
    return PreparedRun(cfg, attn, device_type, world_size, ds_config, tokenizer, prepared, plan_cfg, loss_cfg, resume)


# Set by the deepspeed launcher and torchrun; under mpirun they are missing and come from MPI discovery.
RENDEZVOUS_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def check_sequence_parallel_settings(cfg: TrainConfig, world_size: int, attn: str, vocab_size: int) -> int:
    """The data-parallel size (world / --sequence-parallel-size), or InputError for a layout that cannot work."""
    from .engines import model_config
    from .sequence_parallel import check_attention, check_model_heads, data_parallel_size

    sp_size = cfg.sequence_parallel_size
    dp_world_size = data_parallel_size(world_size, sp_size)
    if sp_size > 1:
        check_attention(attn, sp_size)
        if not cfg.packing:
            raise InputError(f"--sequence-parallel-size {sp_size} splits packed rows; it cannot be combined with "
                             f"--no-packing")
        where = f"--model {cfg.model}" if cfg.model else f"--model-config {cfg.model_config or 'tiny'}"
        check_model_heads(model_config(cfg, vocab_size), sp_size, where)
    return dp_world_size


def init_process_group(cfg: TrainConfig) -> None:
    import deepspeed
    from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT

    from .build_lock import remove_stale_locks

    remove_stale_locks()  # init_distributed JIT-builds DeepSpeed's CPU comm extension: a stale lock hangs it
    if not all(key in os.environ for key in RENDEZVOUS_ENV):
        # DeepSpeed's MPI discovery (what init_distributed(auto_mpi_discovery=True) runs) sets MASTER_PORT to its
        # argument, not to the environment's, and MASTER_ADDR to rank 0's first `hostname -I` address: run it
        # here with the job's port, then put back an address the job gave (launch/mpirun.sh exports both).
        master_addr = os.environ.get("MASTER_ADDR")
        deepspeed.comm.mpi_discovery(int(os.environ.get("MASTER_PORT", TORCH_DISTRIBUTED_DEFAULT_PORT)), verbose=False)
        if master_addr:
            os.environ["MASTER_ADDR"] = master_addr
    # The timeout bounds every collective: a dead rank ends the others with an error instead of a hang.
    deepspeed.init_distributed(timeout=timedelta(seconds=cfg.collective_timeout_s), auto_mpi_discovery=True,
                               verbose=False)


class StepTimer:
    """Wall time of one optimizer step, synchronized with the accelerator."""

    def __init__(self):
        from deepspeed.accelerator import get_accelerator

        self._accel = get_accelerator()
        self.start = 0.0

    def begin(self):
        self._accel.synchronize()
        self.start = time.perf_counter()

    def seconds(self) -> float:
        self._accel.synchronize()
        return time.perf_counter() - self.start


class DPOTrainer:
    """Runs the plan on the engines and reports one metrics record per optimizer step."""

    def __init__(self, run: PreparedRun, policy, reference, sequence_parallel=None):
        import torch.distributed as dist

        from .engines import zero_stage
        from ..model.logps import forward_logps
        from .sequence_parallel import gradient_average_size

        self.run = run
        self.cfg = run.cfg
        self.policy = policy
        self.reference = reference
        self.rank = dist.get_rank()
        sp_size = self.cfg.sequence_parallel_size
        # Consecutive ranks share a row: rank r runs the rows the plan deals to data-parallel rank r // S.
        self.plan_rank = self.rank // sp_size
        self.dp_world_size = dist.get_world_size() // sp_size
        self.gradient_average_size = gradient_average_size(zero_stage(run.ds_config), dist.get_world_size(), sp_size)
        if self.dp_world_size != run.plan_cfg.world_size:
            raise RuntimeError(f"process group has {dist.get_world_size()} ranks but the launcher announced "
                               f"{run.plan_cfg.world_size * sp_size}")
        self.forward_logps = sequence_parallel.forward_logps if sequence_parallel else forward_logps
        # The S ranks of a group hold the same whole-sequence sums: only the first one counts them in the metrics.
        self.counts_metrics = sequence_parallel is None or sequence_parallel.rank == 0
        self.device = policy.device
        self.pad_token_id = run.pad_token_id
        self.columns = run.prepared.dataset

    # ------------------------------------------------------------------
    def _row_batch(self, row):
        from ..model.collate import collate_packed, collate_padded

        indices = list(row.pairs)
        if indices:
            cols = self.columns[indices]
            pairs = [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r}
                     for p, c, r in zip(cols["prompt_ids"], cols["chosen_ids"], cols["rejected_ids"])]
        else:
            pairs = []
        collate = collate_packed if self.cfg.packing else collate_padded
        return collate(pairs, indices, self.pad_token_id).to(self.device)

    def _reference_logps(self, batch):
        from .reference import reference_logps

        return reference_logps(self.reference, batch, self.run.model_attn, self.cfg.logps_chunk_tokens,
                               self.cfg.logps_impl, forward=self.forward_logps)

    def _skip_if_any_rank_bad(self, loss, bad):
        """Makes a step with a non-finite loss on any rank a step DeepSpeed skips, on every rank alike.

        ZeRO's ``step()`` discards a step whose global gradient norm is inf/NaN (the
        norm is all-reduced, so every rank decides the same; ``was_step_applied()``
        then says False).  A loss can be non-finite while the gradients are not (a
        reference log-prob of -inf), so the loss flag is all-reduced here and such a
        step's gradient made NaN on every rank, which routes it into the same skip.
        """
        import torch.distributed as dist

        flag = bad.float().reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return loss * float("nan") if flag.item() > 0 else loss

    def train_step(self, plan, inject_nan: bool = False) -> dict:
        """One optimizer step over this rank's rows; returns the metrics of the whole step (all ranks).

        ``inject_nan`` (fault injection, tests only) makes every loss of the step NaN.
        """
        import torch
        import torch.distributed as dist

        from ..model.losses import global_normalized_loss, metric_means, metric_sums, pair_losses

        rows = plan.ranks[self.plan_rank]
        sums: dict[str, torch.Tensor] = {}
        bad = torch.zeros((), dtype=torch.bool, device=self.device)
        lr = self.policy.get_lr()[0] if self.policy.get_lr() else self.cfg.lr
        for i, row in enumerate(rows):
            batch = self._row_batch(row)
            ref = self._reference_logps(batch)
            self.policy.set_gradient_accumulation_boundary(i == len(rows) - 1)
            pol = self.forward_logps(self.policy, batch, self.run.model_attn, self.cfg.logps_chunk_tokens,
                                     self.cfg.logps_impl)
            losses, per_pair = pair_losses(pol, ref, self.run.loss_cfg)
            if inject_nan:
                losses = losses * float("nan")
            bad |= ~torch.isfinite(losses.detach()).all()
            loss = global_normalized_loss(losses, plan.num_pairs, self.gradient_average_size)
            if i == len(rows) - 1:
                loss = self._skip_if_any_rank_bad(loss, bad)
            self.policy.backward(loss, scale_wrt_gas=False)
            self.policy.step()
            row_sums = metric_sums(per_pair, pol)
            row_sums["loss_sum"] = losses.detach().sum()
            row_sums["real_tokens"] = torch.tensor(float(batch.real_tokens), device=self.device)
            row_sums["computed_tokens"] = torch.tensor(float(batch.computed_tokens), device=self.device)
            for key, value in row_sums.items():
                sums[key] = sums.get(key, 0.0) + value.detach().float() * float(self.counts_metrics)
        keys = sorted(sums)
        packed = torch.stack([torch.as_tensor(sums[k], device=self.device).reshape(()) for k in keys])
        dist.all_reduce(packed)  # one collective per step for every metric
        totals = dict(zip(keys, packed.tolist()))
        metrics = metric_means({k: v for k, v in totals.items() if k not in STEP_SUM_KEYS})
        grad_norm = self.policy.get_global_grad_norm()
        metrics.update({
            "loss": totals["loss_sum"] / max(totals["pairs"], 1.0),
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "lr": float(lr),
            "skipped": not self.policy.was_step_applied(),
            "pairs": int(round(totals["pairs"])),
            "tokens": int(round(totals["real_tokens"])),
            "computed_tokens": int(round(totals["computed_tokens"])),
            "rows_per_rank": len(rows),
            "max_rank_tokens": max(plan.rank_tokens),
            "mean_rank_tokens": sum(plan.rank_tokens) / len(plan.rank_tokens),
        })
        return metrics

    def write_monitor(self, metrics: dict) -> None:
        """Hands the step's figures to DeepSpeed's monitors (tensorboard, csv, wandb, comet) as ``Train/<name>``.

        They are indexed like DeepSpeed's own events (its ``Train/Samples/lr``, written inside
        ``engine.step()``): by the engine's ``global_samples`` (here the world size times the optimizer
        step).  With the optimizer step as index, behind DeepSpeed's on 2+ ranks, wandb would drop
        every one of them (its steps must never go back).  ``Train/step`` maps the index to the step.
        """
        monitor = getattr(self.policy, "monitor", None)
        if monitor is not None and getattr(monitor, "enabled", False):
            index = self.policy.global_samples
            events = [(f"Train/{k}", v, index) for k, v in metrics.items()
                      if isinstance(v, (int, float)) and math.isfinite(v)]
            monitor.write_events(events)


def total_steps(run: PreparedRun) -> int:
    from ..data.plan import steps_per_epoch

    lengths = (run.prepared.chosen_lengths, run.prepared.rejected_lengths)
    steps = sum(steps_per_epoch(*lengths, run.plan_cfg, epoch=e) for e in range(run.cfg.epochs))
    return min(steps, run.cfg.max_steps) if run.cfg.max_steps else steps


def throughput_meter(run: PreparedRun, policy, reference):
    """Model TFLOP/s and MFU per step, counted like the bench counts them (``flops.py``)."""
    from ..model.flops import FlopModel, ThroughputMeter

    return ThroughputMeter(FlopModel.of(policy, with_reference=reference is not None), run.prepared.chosen_lengths,
                           run.prepared.rejected_lengths, packed=run.cfg.packing, world_size=run.world_size,
                           peak_tflops=run.cfg.peak_tflops)


def train(cfg: TrainConfig) -> list[dict]:
    """The whole job on this rank; returns the per-step metrics (rank 0 also writes them)."""
    from tqdm.auto import tqdm

    from . import faults
    from .checkpoint import Checkpointer, ResumePoint, trim_metrics
    from .engines import build_engines, zero_stage
    from ..model.guard import assert_packing_exact
    from ..data.plan import iter_plan
    from .reference import load_precomputed_reference

    run = prepare_run(cfg)
    resume = run.resume
    precomputed = load_precomputed_reference(run)  # the --ref-logps file, checked before any process group
    init_process_group(cfg)
    sequence_parallel = mpu = None
    if cfg.sequence_parallel_size > 1:
        from .sequence_parallel import init_sequence_parallel

        sequence_parallel, mpu = init_sequence_parallel(cfg.sequence_parallel_size, run.attn, run.pad_token_id)
    policy, reference = build_engines(cfg, run.ds_config, len(run.tokenizer), run.model_attn, mpu)
    trainer = DPOTrainer(run, policy, precomputed or reference, sequence_parallel)
    checkpointer = Checkpointer(cfg, run, trainer.rank, trainer.dp_world_size, zero_stage(run.ds_config))
    if resume is not None:
        checkpointer.restore(policy, resume)
    if cfg.packing and not cfg.skip_packing_check:
        assert_packing_exact(policy, run.model_attn, len(run.tokenizer), trainer.pad_token_id, device=trainer.device,
                             forward=trainer.forward_logps)

    steps = total_steps(run)
    start = resume or ResumePoint(None, epoch=0, epoch_step=0, global_step=0, bad_steps=0)
    meter = throughput_meter(run, policy, reference) if run.device_type == "cuda" else None
    is_main = trainer.rank == 0
    metrics_file = None
    if is_main:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.output_dir) / "run_config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
        (Path(cfg.output_dir) / "data_summary.json").write_text(json.dumps(run.prepared.summary, indent=2) + "\n")
        metrics_path = Path(cfg.resolved_metrics_out)
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
        if resume is not None:
            trim_metrics(metrics_path, start.global_step)  # records of steps the resume undoes
        metrics_file = open(metrics_path, "a" if resume is not None else "w")
    bar = tqdm(total=steps, initial=min(start.global_step, steps), disable=not (is_main and cfg.progress), desc="dpo",
               unit="step", dynamic_ncols=True)
    history = []
    timer = StepTimer()
    global_step, bad_steps = start.global_step, start.bad_steps
    position = (start.epoch, start.epoch_step)  # plan position of the next step
    plans = iter_plan(run.prepared.chosen_lengths, run.prepared.rejected_lengths, run.plan_cfg, cfg.epochs,
                      start_epoch=start.epoch, start_step=start.epoch_step)
    try:
        for plan in plans:  # collectives here fail fast on a dead peer, after --collective-timeout-s on a stalled one
            if global_step >= steps:
                break
            faults.kill_point(trainer.rank, global_step + 1)
            timer.begin()
            metrics = trainer.train_step(plan, inject_nan=faults.nan_step(global_step + 1))
            seconds = timer.seconds()
            global_step += 1
            position = (plan.epoch, plan.step + 1)
            bad_steps = bad_steps + 1 if metrics["skipped"] else 0
            record = {"step": global_step, "epoch": plan.epoch, "epoch_step": plan.step, **metrics,
                      "step_time_s": seconds, "tokens_per_s": metrics["tokens"] / seconds,
                      "pairs_per_s": metrics["pairs"] / seconds}
            if meter is not None:
                record.update(meter.figures(meter.step_flops(plan), seconds))
            history.append(record)
            if is_main and metrics["skipped"]:
                logger.warning(f"step {global_step} skipped: non-finite loss or gradient "
                               f"({bad_steps} in a row, --max-bad-steps {cfg.max_bad_steps})")
            if is_main:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()  # a crash loses at most the step in flight
                trainer.write_monitor(record)
                bar.set_postfix(loss=f"{record['loss']:.4f}", acc=f"{record['rewards/accuracies']:.2f}",
                                tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
                bar.update(1)
            if bad_steps >= cfg.max_bad_steps:
                raise TooManyBadStepsError(f"{bad_steps} consecutive steps (up to step {global_step}) had a non-finite "
                                           f"loss or gradient (--max-bad-steps {cfg.max_bad_steps}); aborting")
            if checkpointer.due(global_step, last=global_step >= steps):
                checkpointer.save(policy, global_step, *position, bad_steps)
        if cfg.export_on_end:
            checkpointer.export_on_end(policy, global_step, position, bad_steps, resumed=resume is not None)
    except RuntimeError as error:
        if isinstance(error, RunAbortedError) or not _is_collective_failure(error):
            raise
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise PeerFailureError(
            f"rank {trainer.rank}: a collective failed after step {global_step}: another rank died or stalled longer "
            f"than --collective-timeout-s {cfg.collective_timeout_s:g}; relaunch with --resume auto to continue from "
            f"the last complete checkpoint ({first_line})") from error
    finally:
        bar.close()
        if metrics_file is not None:
            metrics_file.close()
    return history

