"""One assembly for every run: train, each bench configuration, precompute-ref and check build their run here.

Phase one (:func:`prepare`) needs no process group: settings, the parallel layout, the
DeepSpeed config, the model config, the tokenized data, the plan, the resume point (and
the universal form of a checkpoint resumed at another layout) and a precomputed
reference file are all checked, so bad input ends in one line on every
rank (and in the front ``ds-packdpo train`` process, before any launch) before anything
heavy starts.  Phase two (:func:`start`) starts the process group, the sequence-parallel
groups and their attention, the engines (or only the reference, or a precomputed
reference) and runs the packing guard.  Nothing else builds engines, models or the
sequence-parallel set-up, so every command runs every layout it accepts the same way.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from deepspeed.accelerator import get_accelerator

from ..config import TrainConfig, resolve_dtype
from ..console import quiet_libraries
from ..data.plan import PlanConfig
from ..data.prepare import PreparedPairs
from ..data.run_plan import checked_plan_config, total_steps
from ..data.source import prepare_run_data, split_held_out, tokenizer_and_rows
from ..data.tokenizer import pad_token_id
from ..errors import InputError
from ..files import check_not_an_input, replaces
from ..model.attention import (OWN_KERNELS, SDPA_VARLEN, ULYSSES_ATTN, check_model_attention, is_flash,
                                resolve_attn)
from ..model.torch_varlen import TORCH_VARLEN
from ..model.collate import ModelBatch, collate_row, collate_spread_row
from ..model.fused_logps import resolve_logps_impl
from ..model.guard import assert_packing_exact
from ..model.hf_folder import shard_size_bytes
from ..model.logps import AUTO_CHUNK, SequenceLogps, TokenWeighting, forward_logps
from ..model.lora import LoraSettings, as_reference, check_adapters, parameter_counts
from ..model.loss_registry import LossConfig
from ..model.prefix_attention import PREFIX_FLASH
from .checkpoint import ResumePoint, check_resume, export_on_end_dir, resolved_save_dir, resumes_in_place
from .engines import (build_evaluated_policy, build_policy, build_reference, fill_ds_config, load_ds_config, load_model,
                      model_config, reference_ds_config, reference_model_config, zero_stage)
from .evaluation import HeldOut, held_out_set
from .layout import ParallelLayout
from .process_group import init_process_group
from .reference import PrecomputedReference, load_precomputed_reference
from .reference_sync import check_sync_settings
from .schedule import Schedule, run_schedule
from .sequence_parallel import SequenceParallel, check_attention, check_model_heads, init_sequence_parallel
from .universal import ensure_universal, with_universal_loading
from .user_values import check_adam_settings, take_user_values

# What each command builds in phase two: a trained policy (with its reference), or only a frozen reference,
# or (check) one model in this process with no process group.
TRAINING_COMMANDS = ("train", "bench")
COMMANDS = (*TRAINING_COMMANDS, "eval", "precompute-ref", "check")
# The commands that hold pairs out of --dataset (--eval-fraction) or read --eval-dataset.
EVALUATING_COMMANDS = (*TRAINING_COMMANDS, "eval")


@dataclass
class RunSetup:
    """What phase one hands to phase two: validated settings, layout, data and plan."""

    cfg: TrainConfig
    command: str
    layout: ParallelLayout
    device_type: str
    attn: str  # the resolved backend (the local attention under sequence parallelism)
    ds_config: dict
    tokenizer: object
    prepared: PreparedPairs  # the pairs the run trains on (or computes the reference of)
    plan_cfg: PlanConfig
    loss_cfg: LossConfig
    schedule: Schedule  # the LR schedule over the run's total steps
    resume: ResumePoint | None = None  # None: a fresh start
    precomputed: PrecomputedReference | None = None  # the --ref-logps file
    held_out: HeldOut | None = None  # the evaluation's pairs, plan and precomputed reference

    @property
    def prefix_sharing(self) -> bool:
        """Rows lay out each pair as [prompt | chosen | rejected] (phase one refused a backend that cannot, except for
        ``check``, which then checks packing alone)."""
        return self.cfg.shares_prefixes and runs_prefix_sharing(self.attn, self.layout.sp_size, self.device_type,
                                                                self.cfg.dtype)

    @property
    def model_attn(self) -> str:
        """The model's attn_implementation: Ulysses (around ``attn``) under sequence parallelism; flash-attn with
        prefix sharing through ``PREFIX_FLASH``."""
        if self.layout.sp_size > 1:
            return ULYSSES_ATTN
        return PREFIX_FLASH[self.attn] if self.prefix_sharing and is_flash(self.attn) else self.attn

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def pad_token_id(self) -> int:
        return pad_token_id(self.tokenizer)


def check_output_dir(cfg: TrainConfig) -> None:
    """A training run writes into an empty folder, its own folder when it resumes, or any with --overwrite."""
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"--output-dir {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not cfg.overwrite and not resumes_in_place(cfg):
        if cfg.resume:
            raise InputError(f"--output-dir {out}: folder is not empty and holds no checkpoint of this run to "
                             "resume; pass --overwrite to write into it")
        raise InputError(f"--output-dir {out}: folder is not empty (pass --overwrite to write into it, or "
                         "--resume auto to continue the run saved there)")
    if not cfg.export_on_end:
        return
    # round two from round one's export: its model, the reference too, replaced at the end
    check_not_an_input(export_on_end_dir(cfg), "--export-on-end", cfg.local_inputs())
    if replaces(export_on_end_dir(cfg), resolved_save_dir(cfg)):  # else said at the end, after the training
        raise InputError(f"--save-dir {cfg.save_dir}: inside {export_on_end_dir(cfg)}, which --export-on-end replaces "
                         f"with the model exported from it; save elsewhere")


def prefix_sharing_obstacle(attn: str, sp_size: int, device_type: str, dtype: str) -> str | None:
    """Why ``attn`` cannot run prefix-shared rows here (None: it can).  sdpa_varlen, torch_varlen and flash-attn run
    them at one rank, every local attention of Ulysses too; transformers' sdpa, eager and flex_attention derive their
    masks from position ids, which cannot say [prompt | chosen | rejected].  sdpa_varlen's shared rows gave
    non-finite or huge gradients on CUDA in half precision (H200, torch 2.11, two runs of the matrix) while its
    kernel alone was exact: not trusted there until understood."""
    if sp_size > 1 or is_flash(attn) or attn == TORCH_VARLEN:
        return None
    if attn == SDPA_VARLEN:
        if device_type == "cuda" and dtype != "fp32":
            return (f"{SDPA_VARLEN}'s prefix-shared rows gave non-finite gradients on CUDA in half precision (README "
                    f"'On a GPU'); {TORCH_VARLEN} or flash-attn share prefixes there")
        return None
    return f"{attn} derives its masks from position ids, which cannot say [prompt | chosen | rejected]"


def runs_prefix_sharing(attn: str, sp_size: int, device_type: str, dtype: str) -> bool:
    """Whether ``attn`` runs prefix-shared rows on this device and dtype (:func:`prefix_sharing_obstacle`)."""
    return prefix_sharing_obstacle(attn, sp_size, device_type, dtype) is None


def settle_prefix_sharing(cfg: TrainConfig, attn: str, layout: ParallelLayout, device_type: str) -> TrainConfig:
    """Prefix sharing is on by default for packed runs; where the backend cannot run it, that default gives way with
    a one-line warning.  A written --prefix-sharing with such a backend is refused."""
    why = prefix_sharing_obstacle(attn, layout.sp_size, device_type, cfg.dtype)
    if not cfg.shares_prefixes or why is None:
        return cfg
    if not cfg.is_given("prefix_sharing"):
        if layout.rank == 0:
            print(f"warning: --attn {attn}: prefix sharing off ({why}); every prompt runs twice", file=sys.stderr,
                  flush=True)
        return dataclasses.replace(cfg, prefix_sharing=False)
    raise InputError(f"--attn {attn}: prefix sharing (on by default for packed runs) needs --attn auto, "
                     f"{SDPA_VARLEN}, {TORCH_VARLEN}, flash_attention_2 or flash_attention_3 ({why}); add "
                     f"--no-prefix-sharing to run {attn}")


def model_source(cfg: TrainConfig) -> str:
    """The flag that names the policy model, for error messages."""
    return f"--model {cfg.model}" if cfg.model else f"--model-config {cfg.model_config or 'tiny'}"


def check_layout_settings(cfg: TrainConfig, layout: ParallelLayout, attn: str, hf_config) -> None:
    """What a sequence-parallel layout needs of the settings and the model, before any weights exist."""
    if layout.sp_size == 1:
        return
    check_attention(attn, layout.sp_size)
    if not cfg.packing:
        raise InputError(f"--sequence-parallel-size {layout.sp_size} splits packed rows; it cannot be combined with "
                         f"--no-packing")
    check_model_heads(hf_config, layout.sp_size, model_source(cfg))


def check_lora_settings(cfg: TrainConfig, hf_config) -> None:
    """--lora-*: the adapters fit the model (placed on its skeleton, with no weights)."""
    lora = LoraSettings.of(cfg)
    if lora is not None:
        check_adapters(lora, hf_config, model_source(cfg), cfg.trust_remote_code)


def check_models(cfg: TrainConfig, layout: ParallelLayout, attn: str, vocab_size: int):
    """Phase one's look at the models' configs (no weights): the backend honours every attention feature of the
    policy and the reference (sliding windows, soft-caps, ...), the layout fits their heads; a mixture-of-experts
    router loss is named as excluded.  Returns the policy's HF config."""
    hf_config = model_config(cfg, vocab_size)
    # Under sequence parallelism the model's attention is Ulysses around the local kernel: the per-sequence kernel
    # of sdpa_varlen for sdpa too, or a varlen kernel (flash-attn's, torch's).
    kernel = SDPA_VARLEN if layout.sp_size > 1 and attn == "sdpa" else attn
    check_model_attention(hf_config, kernel, model_source(cfg))
    if cfg.ref_model is not None:
        check_model_attention(reference_model_config(cfg, vocab_size), kernel, f"--ref-model {cfg.ref_model}")
    check_layout_settings(cfg, layout, attn, hf_config)
    if getattr(hf_config, "output_router_logits", False):
        # DPO's loss is a sum over pairs; a router load-balancing loss is one per packed row (over all its
        # tokens), which would make the loss depend on how pairs are packed (invariant 2).
        warnings.warn(f"{model_source(cfg)}: the mixture-of-experts router auxiliary loss (output_router_logits, "
                      f"router_aux_loss_coef {getattr(hf_config, 'router_aux_loss_coef', None)}) is not added to "
                      f"the DPO loss", stacklevel=2)
    return hf_config


def prepare(cfg: TrainConfig, command: str = "train", world_size: int | None = None,
            dry_run: bool = False) -> RunSetup:
    """Phase one: every check that needs no process group.

    ``world_size`` is the launch's when called before launching (the front command);
    under a launcher the layout comes from its environment.  ``check`` runs in one
    process.  ``--dtype auto`` is resolved here: the set-up's settings name the dtype
    that runs.  ``dry_run`` (``train --dry-run``) leaves a checkpoint resumed at another layout unconverted.
    """
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}")
    quiet_libraries(cfg.verbose)
    device_type = get_accelerator().device_name()
    raw_ds, ds_source = load_ds_config(cfg.ds_config)
    layout = ParallelLayout.from_launch(cfg.sequence_parallel_size, zero_stage(raw_ds),
                                        world_size=1 if command == "check" else world_size)
    cfg, raw_ds = take_user_values(cfg, raw_ds, ds_source, layout.dp_size)
    check_adam_settings(cfg)
    cfg = dataclasses.replace(cfg, dtype=resolve_dtype(cfg.dtype, device_type))
    attn = resolve_attn(cfg.attn, device_type, needs_backward=command in TRAINING_COMMANDS, dtype=cfg.dtype)
    loss_cfg = cfg.loss_config()
    if command == "train":
        check_output_dir(cfg)
        shard_size_bytes(cfg.max_shard_size)  # --export-on-end's, refused before any work
    if command == "eval":
        check_evaluation_models(cfg, loss_cfg)
    if command != "check":  # check reports packing alone for a backend that cannot share prefixes
        cfg = settle_prefix_sharing(cfg, attn, layout, device_type)
    tokenizer, rows = tokenizer_and_rows(cfg)
    hf_config = check_models(cfg, layout, attn, len(tokenizer))
    check_lora_settings(cfg, hf_config)
    check_sync_settings(cfg, command, raw_ds, hf_config, len(tokenizer))
    lora = LoraSettings.of(cfg)
    cfg = dataclasses.replace(cfg, logps_impl=resolve_logps_impl(
        cfg.logps_impl, device_type, getattr(hf_config, "final_logit_softcapping", None),
        lora is not None and lora.adapts_head))
    prepared = prepare_run_data(cfg, tokenizer, rows)
    held_out = None
    if command in EVALUATING_COMMANDS:
        prepared, held_out = split_held_out(cfg, tokenizer, prepared)
    if command == "eval" and held_out is None:  # no held-out part named: evaluate on --dataset (--max-pairs) itself
        held_out = prepared
    plan_cfg = checked_plan_config(cfg, layout, prepared)
    schedule = run_schedule(cfg, total_steps(cfg, plan_cfg, prepared))
    ds_config = fill_ds_config(raw_ds, ds_source, cfg, layout.dp_size, int(getattr(hf_config, "hidden_size", 1024)),
                               device_type, schedule)
    if cfg.ref_offload:  # the reference's own config, so that a stage without parameter offload ends here, not in a rank
        reference_ds_config(ds_config, offload=True, source=ds_source)
    setup = RunSetup(cfg, command, layout, device_type, attn, ds_config, tokenizer, prepared, plan_cfg, loss_cfg,
                     schedule)
    if command == "train":
        setup.resume = check_resume(cfg, prepared.fingerprint, layout)
        if setup.resume is not None and setup.resume.universal and not dry_run:
            if layout.rank == 0:  # once, before any process group: the other ranks wait for rank 0 to start it
                ensure_universal(setup.resume.tag_dir, setup.resume.global_step)
            setup.ds_config = with_universal_loading(setup.ds_config)
    if command in EVALUATING_COMMANDS:
        setup.precomputed = load_precomputed_reference(setup)
    if held_out is not None:
        setup.held_out = held_out_set(setup, held_out)
    return setup


def check_evaluation_models(cfg: TrainConfig, loss_cfg: LossConfig) -> None:
    """``eval`` compares a trained policy (--model) with the model it was trained from: without that reference every
    reward would be 0 (SimPO needs none)."""
    if cfg.model is None:
        raise InputError("eval: --model is required (the trained or exported Hugging Face folder to evaluate)")
    if cfg.ref_model is None and cfg.ref_logps is None and loss_cfg.needs_reference:
        raise InputError("eval: --ref-model (the model the policy was trained from) or --ref-logps is required: with "
                         "--model as its own reference every reward is 0")


class AdaptersOff:
    """The reference of a LoRA run without --ref-model: the policy itself with its adapters switched off."""


@dataclass
class Run:
    """An assembled run: the engines (or the reference alone) and how to turn a planned row into log-probs."""

    setup: RunSetup
    policy: object | None  # the DeepSpeed policy engine (None for precompute-ref)
    reference: object | None  # a reference engine or module, a PrecomputedReference, AdaptersOff, or None (SimPO)
    sequence_parallel: SequenceParallel | None
    packing_check: dict | None = None  # the start-up guard's report (None: padded, or --skip-packing-check)

    @property
    def device(self) -> torch.device:
        return torch.device(get_accelerator().current_device_name())

    @property
    def reference_is_precomputed(self) -> bool:
        return isinstance(self.reference, PrecomputedReference)

    def _forward(self, model, batch: ModelBatch, attn: str, chunk_tokens: int | str = AUTO_CHUNK, impl: str = "lean",
                 weighting: TokenWeighting | None = None):
        """One forward's per-sequence log-probs; under sequence parallelism each rank runs its slice."""
        if self.sequence_parallel is not None:
            return self.sequence_parallel.forward_logps(model, batch, attn, chunk_tokens, impl, weighting)
        return forward_logps(model, batch, attn, chunk_tokens, impl, weighting)

    def forward_logps(self, model, batch: ModelBatch, policy: bool = True) -> SequenceLogps:
        """The per-sequence log-probs the loss takes (LD-weighted with --ld-alpha; the policy's with WPO's
        statistic under --use-weighting)."""
        cfg = self.setup.cfg
        return self._forward(model, batch, self.setup.model_attn, cfg.logps_chunk, cfg.logps_impl,
                             self.setup.loss_cfg.token_weighting(policy))

    def reference_logps(self, batch: ModelBatch) -> SequenceLogps | None:
        """The reference log-probs of ``batch``: looked up, run without gradients (a reference model, or the LoRA
        policy with its adapters off: the same packed row and backend), or None (SimPO)."""
        if self.reference is None:
            return None
        if self.reference_is_precomputed:
            return self.reference.sequence_logps(batch)
        if isinstance(self.reference, AdaptersOff):
            with torch.no_grad(), as_reference(self.policy):
                return self.forward_logps(self.policy, batch, policy=False)
        with torch.no_grad():
            return self.forward_logps(self.reference, batch, policy=False)

    def row_batch(self, row, plan) -> ModelBatch:
        """The model inputs of one planned row of ``plan`` (a StepPlan), packed (each prompt once with prefix sharing),
        padded, or of responses spread over ranks as the plan lays them out, on this rank's device."""
        setup = self.setup
        if plan.responses is not None:
            return collate_spread_row(setup.prepared.dataset, plan.responses, row.responses,
                                      setup.pad_token_id).to(self.device)
        return collate_row(setup.prepared.dataset, row.pairs, setup.pad_token_id, setup.cfg.packing,
                           shared_prefix=setup.prefix_sharing,
                           grouped=setup.prefix_sharing and setup.cfg.prompt_groups).to(self.device)

    def check_packing(self) -> None:
        """The start-up guard (packed runs): packed log-probs, in the run's layout (prefix-shared or not), equal each
        sequence alone (eager), on every rank together."""
        model = self.policy if self.policy is not None else self.reference
        self.packing_check = assert_packing_exact(model, self.setup.model_attn, self.setup.vocab_size,
                                                  self.setup.pad_token_id, device=self.device, forward=self._forward,
                                                  shared_prefix=self.setup.prefix_sharing)

    def close(self) -> None:
        """Frees the engines before the next run of this process is built (a bench's next configuration)."""
        for engine in (self.policy, self.reference):
            if engine is not None and hasattr(engine, "destroy"):
                engine.destroy()
        self.policy = self.reference = None
        gc.collect()
        get_accelerator().empty_cache()


def start(setup: RunSetup) -> Run:
    """Phase two: process group, sequence-parallel groups and attention, engines, packing guard."""
    cfg, layout = setup.cfg, setup.layout
    init_process_group(layout, cfg.collective_timeout_s, quiet=not cfg.verbose)
    sequence_parallel = mpu = None
    if layout.sp_size > 1:
        sequence_parallel, mpu = init_sequence_parallel(layout, setup.attn, setup.pad_token_id)
    policy = None
    if setup.command in TRAINING_COMMANDS:
        policy = build_policy(cfg, setup.ds_config, setup.vocab_size, setup.model_attn, mpu)
        if layout.rank == 0:
            print(trainable_line(policy.module, LoraSettings.of(cfg)), flush=True)
    elif setup.command == "eval":
        policy = build_evaluated_policy(cfg, setup.ds_config, setup.vocab_size, setup.model_attn, mpu)
    if setup.precomputed is not None:
        reference = setup.precomputed
    elif setup.command in EVALUATING_COMMANDS and not setup.loss_cfg.needs_reference:
        reference = None  # reference-free
    elif setup.command in TRAINING_COMMANDS and cfg.lora_r and cfg.ref_model is None:
        reference = AdaptersOff()  # no second model: the base weights are the policy's own, frozen
    else:
        reference = build_reference(cfg, setup.ds_config, setup.vocab_size, setup.model_attn, mpu)
    run = Run(setup, policy, reference, sequence_parallel)
    if cfg.packing and not cfg.skip_packing_check:
        run.check_packing()
    return run


def trainable_line(model, lora: LoraSettings | None) -> str:
    """The start-up line that says what the optimizer trains."""
    trainable, total = parameter_counts(model)
    what = "every weight" if lora is None else (f"LoRA r={lora.r} alpha={lora.alpha:g} on {lora.target_modules}, "
                                                "base weights frozen")
    return f"trainable parameters: {trainable:,} of {total:,} ({100.0 * trainable / max(total, 1):.2f}%; {what})"


def model_alone(setup: RunSetup):
    """``check``: the policy model in this process, no process group and no DeepSpeed, on the accelerator."""
    model = load_model(setup.cfg, setup.cfg.model, setup.vocab_size, setup.model_attn)
    return model.to(get_accelerator().current_device_name())
