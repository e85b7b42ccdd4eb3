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
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from .config import TrainConfig, to_dict
from .errors import InputError

STEP_SUM_KEYS = ("loss_sum", "real_tokens", "computed_tokens")


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

    @property
    def model_attn(self) -> str:
        """The model's attn_implementation: Ulysses (around ``attn``) under sequence parallelism."""
        from .attention import ULYSSES_ATTN

        return ULYSSES_ATTN if self.cfg.sequence_parallel_size > 1 else self.attn

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0


def _tokenizer_and_rows(cfg: TrainConfig):
    from .synthetic import default_tokenizer, synthetic_preference_rows
    from .tokenizer import load_tokenizer

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

    from .data import DEFAULT_CACHE_DIR, DataConfig, prepare_pairs

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
        raise InputError(f"--output-dir {out}: folder is not empty (pass --overwrite to write into it)")


def prepare_run(cfg: TrainConfig) -> PreparedRun:
    """Phase one: every check that needs no process group."""
    from deepspeed.accelerator import get_accelerator

    from .attention import resolve_attn
    from .engine import fill_ds_config, launch_world_size, load_ds_config, model_hidden_size
    from .losses import LossConfig
    from .packing import PlanConfig, validate_lengths

    device_type = get_accelerator().device_name()
    attn = resolve_attn(cfg.attn, device_type)
    loss_cfg = LossConfig(loss_type=cfg.loss, beta=cfg.beta, label_smoothing=cfg.label_smoothing,
                          simpo_gamma=cfg.simpo_gamma, rpo_alpha=cfg.rpo_alpha)
    loss_cfg.validate()
    world_size = launch_world_size()
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
                          packing=not cfg.no_packing, micro_batch_pairs=cfg.micro_batch_pairs)
    prepared = prepare_data(cfg, tokenizer, rows)
    if len(prepared.chosen_lengths) == 0:
        raise InputError(f"--dataset {cfg.dataset or 'synthetic'}: no pairs left after validation and truncation")
    if cfg.sequence_parallel_size > 1:
        from .sequence_parallel import check_pairs_fit

        check_pairs_fit(prepared.chosen_lengths, prepared.rejected_lengths, cfg.row_budget,
                        cfg.sequence_parallel_size, prepared.dataset["pair_id"])
    validate_lengths(prepared.chosen_lengths, prepared.rejected_lengths, plan_cfg,
                     pair_ids=prepared.dataset["pair_id"])
    return PreparedRun(cfg, attn, device_type, world_size, ds_config, tokenizer, prepared, plan_cfg, loss_cfg)


def check_sequence_parallel_settings(cfg: TrainConfig, world_size: int, attn: str, vocab_size: int) -> int:
    """The data-parallel size (world / --sequence-parallel-size), or InputError for a layout that cannot work."""
    from .engine import model_config
    from .sequence_parallel import check_attention, check_model_heads, data_parallel_size

    sp_size = cfg.sequence_parallel_size
    dp_world_size = data_parallel_size(world_size, sp_size)
    if sp_size > 1:
        check_attention(attn, sp_size)
        if cfg.no_packing:
            raise InputError(f"--sequence-parallel-size {sp_size} splits packed rows; it cannot be combined with "
                             f"--no-packing")
        where = f"--model {cfg.model}" if cfg.model else f"--model-config {cfg.model_config or 'tiny'}"
        check_model_heads(model_config(cfg, vocab_size), sp_size, where)
    return dp_world_size


def init_process_group(cfg: TrainConfig) -> None:
    import deepspeed

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

        from .engine import zero_stage
        from .logps import forward_logps
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
        from .collate import collate_packed, collate_padded

        indices = list(row.pairs)
        if indices:
            cols = self.columns[indices]
            pairs = [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r}
                     for p, c, r in zip(cols["prompt_ids"], cols["chosen_ids"], cols["rejected_ids"])]
        else:
            pairs = []
        collate = collate_padded if self.cfg.no_packing else collate_packed
        return collate(pairs, indices, self.pad_token_id).to(self.device)

    def _reference_logps(self, batch):
        import torch

        if self.reference is None:
            return None
        with torch.no_grad():
            return self.forward_logps(self.reference, batch, self.run.model_attn, self.cfg.logps_chunk_tokens)

    def train_step(self, plan) -> dict:
        """One optimizer step over this rank's rows; returns the metrics of the whole step (all ranks)."""
        import torch
        import torch.distributed as dist

        from .losses import global_normalized_loss, metric_means, metric_sums, pair_losses

        rows = plan.ranks[self.plan_rank]
        sums: dict[str, torch.Tensor] = {}
        lr = self.policy.get_lr()[0] if self.policy.get_lr() else self.cfg.lr
        for i, row in enumerate(rows):
            batch = self._row_batch(row)
            ref = self._reference_logps(batch)
            self.policy.set_gradient_accumulation_boundary(i == len(rows) - 1)
            pol = self.forward_logps(self.policy, batch, self.run.model_attn, self.cfg.logps_chunk_tokens)
            losses, per_pair = pair_losses(pol, ref, self.run.loss_cfg)
            loss = global_normalized_loss(losses, plan.num_pairs, self.gradient_average_size)
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
            "pairs": int(round(totals["pairs"])),
            "tokens": int(round(totals["real_tokens"])),
            "computed_tokens": int(round(totals["computed_tokens"])),
            "rows_per_rank": len(rows),
            "max_rank_tokens": max(plan.rank_tokens),
            "mean_rank_tokens": sum(plan.rank_tokens) / len(plan.rank_tokens),
        })
        return metrics

    def write_monitor(self, metrics: dict, step: int) -> None:
        monitor = getattr(self.policy, "monitor", None)
        if monitor is not None and getattr(monitor, "enabled", False):
            events = [(f"Train/{k}", v, step) for k, v in metrics.items()
                      if isinstance(v, (int, float)) and math.isfinite(v)]
            monitor.write_events(events)


def total_steps(run: PreparedRun) -> int:
    from .packing import steps_per_epoch

    lengths = (run.prepared.chosen_lengths, run.prepared.rejected_lengths)
    steps = sum(steps_per_epoch(*lengths, run.plan_cfg, epoch=e) for e in range(run.cfg.epochs))
    return min(steps, run.cfg.max_steps) if run.cfg.max_steps else steps


def train(cfg: TrainConfig) -> list[dict]:
    """The whole job on this rank; returns the per-step metrics (rank 0 also writes them)."""
    from tqdm.auto import tqdm

    from .engine import build_engines
    from .models import assert_packing_exact
    from .packing import iter_plan

    run = prepare_run(cfg)
    init_process_group(cfg)
    sequence_parallel = mpu = None
    if cfg.sequence_parallel_size > 1:
        from .sequence_parallel import init_sequence_parallel

        sequence_parallel, mpu = init_sequence_parallel(cfg.sequence_parallel_size, run.attn, run.pad_token_id)
    policy, reference = build_engines(cfg, run.ds_config, len(run.tokenizer), run.model_attn, mpu)
    trainer = DPOTrainer(run, policy, reference, sequence_parallel)
    if not cfg.no_packing and not cfg.skip_packing_check:
        assert_packing_exact(policy, run.model_attn, len(run.tokenizer), trainer.pad_token_id, device=trainer.device,
                             forward=trainer.forward_logps)

    steps = total_steps(run)
    is_main = trainer.rank == 0
    metrics_file = None
    if is_main:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.output_dir) / "run_config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
        (Path(cfg.output_dir) / "data_summary.json").write_text(json.dumps(run.prepared.summary, indent=2) + "\n")
        Path(cfg.resolved_metrics_out).parent.mkdir(parents=True, exist_ok=True)
        metrics_file = open(cfg.resolved_metrics_out, "w")
    bar = tqdm(total=steps, disable=not (is_main and cfg.progress), desc="dpo", unit="step", dynamic_ncols=True)
    history = []
    timer = StepTimer()
    global_step = 0
    try:
        for plan in iter_plan(run.prepared.chosen_lengths, run.prepared.rejected_lengths, run.plan_cfg, cfg.epochs):
            if global_step >= steps:
                break
            timer.begin()
            metrics = trainer.train_step(plan)
            seconds = timer.seconds()
            global_step += 1
            record = {"step": global_step, "epoch": plan.epoch, "epoch_step": plan.step, **metrics,
                      "step_time_s": seconds, "tokens_per_s": metrics["tokens"] / seconds,
                      "pairs_per_s": metrics["pairs"] / seconds}
            history.append(record)
            if is_main:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()  # a crash loses at most the step in flight
                trainer.write_monitor(record, global_step)
                bar.set_postfix(loss=f"{record['loss']:.4f}", acc=f"{record['rewards/accuracies']:.2f}",
                                tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
                bar.update(1)
    finally:
        bar.close()
        if metrics_file is not None:
            metrics_file.close()
    return history
