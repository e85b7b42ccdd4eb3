"""One assembly for every run: train, each bench configuration, precompute-ref and check build their run here.

The flags (``config.TrainConfig``, flat, as users type them) are resolved here once --
every ``auto``, the DeepSpeed config's values, the device, the parallel layout, the row
layout -- into a frozen :class:`RunSpec` of sections, each defined beside the component
that owns it and validating itself.  Nothing below this module reads the flags: a stage
takes its section.

Phase one (:func:`prepare`) needs no process group: the settings, the parallel layout,
the DeepSpeed config, the model config, the tokenized data, the plan, the resume point
(and the universal form of a checkpoint resumed at another layout) and a precomputed
reference file are all checked, so bad input ends in one line on every rank (and in the
front ``ds-packdpo train`` process, before any launch) before anything heavy starts.
Phase two (:func:`start`) starts the process group, the sequence-parallel groups and
their attention, the engines (or only the reference, or a precomputed reference) and
runs the packing guard.  Nothing else builds engines, models or the sequence-parallel
set-up, so every command runs every layout it accepts the same way.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
from pathlib import Path

import torch
from deepspeed.accelerator import get_accelerator

from ..config import TrainConfig, resolve_dtype, to_dict
from ..console import quiet_libraries, say_warning
from ..data.heldout import EvalSpec
from ..data.plan import RowLayout
from ..data.prepare import PreparedPairs
from ..data.run_plan import PlanSpec, RunLength, checked_plan_config, run_length
from ..data.source import DataSpec, prepare_run_data, split_held_out, tokenizer_and_rows
from ..data.tokenizer import pad_token_id
from ..errors import InputError
from ..files import check_not_an_input, replaces
from ..model.attention import (BACKENDS, AttentionSpec, check_model_attention, prefix_sharing_backends,
                                prefix_sharing_obstacle, resolve_attn)
from ..model.build import ModelSpec
from ..model.collate import ModelBatch, collate_row
from ..model.guard import assert_packing_exact
from ..model.hf_folder import shard_size_bytes
from ..model.kernels import liger_obstacle
from ..model.logps import (AUTO_CHUNK, LEAN, LogpsSpec, SequenceLogps, TokenWeighting, forward_logps,
                           resolve_logps_impl)
from ..model.lora import LoraSettings, as_reference, check_adapters, parameter_counts
from ..model.loss_registry import LossConfig
from .checkpoint import CheckpointSpec, ResumePoint, check_resume, plan_fingerprint, resumes_in_place
from .engines import (OptimizerSpec, ZeroSpec, build_evaluated_policy, build_policy, build_reference,
                      fill_ds_config, load_ds_config, load_model, model_config, reference_ds_config,
                      reference_model_config, zero_stage)
from .evaluation import HeldOut, held_out_set
from .layout import ParallelLayout
from .metrics import OutputSpec
from .process_group import init_process_group
from .reference import PrecomputedReference, ReferenceSpec, load_precomputed_reference
from .reference_sync import RefSync, check_sync_settings
from .schedule import Schedule, ScheduleSpec
from .sequence_parallel import SequenceParallel, check_attention, check_model_heads, init_sequence_parallel
from .universal import ensure_universal, with_universal_loading
from .user_values import check_adam_settings, monitor_names, take_user_values

# What each command builds in phase two: a trained policy (with its reference), or only a frozen reference,
# or (check) one model in this process with no process group.
TRAINING_COMMANDS = ("train", "bench")
COMMANDS = (*TRAINING_COMMANDS, "eval", "precompute-ref", "check")
# The commands that hold pairs out of --dataset (--eval-fraction) or read --eval-dataset.
EVALUATING_COMMANDS = (*TRAINING_COMMANDS, "eval")


@dataclass(frozen=True)
class RunSpec:
    """A run's settings, resolved once: a tree of sections, each defined beside the component that owns it and checked
    there as it is made (against what it needs to know of the others)."""

    command: str
    device_type: str  # the accelerator's: cuda, cpu, ...
    layout: ParallelLayout  # run/layout.py: world, data- and sequence-parallel sizes, this rank
    collective_timeout_s: float  # a stalled collective ends the run after this long (run/process_group.py)
    model: ModelSpec  # model/build.py: source, precision, seed, LoRA, activation checkpointing
    reference: ReferenceSpec  # run/reference.py: precomputed log-probs, offload, TR-DPO
    data: DataSpec  # data/source.py: the dataset, its tokenization, the tokenizer
    evaluation: EvalSpec  # data/heldout.py: the held-out pairs and how often they are evaluated
    plan: PlanSpec  # data/run_plan.py: the planner's settings (the row layout among them), epochs, last step
    loss: LossConfig  # model/loss_registry.py: the losses and their parameters
    attention: AttentionSpec  # model/attention.py: the backend and what the model is built with
    logps: LogpsSpec  # model/logps.py: the log-prob implementation and its chunk
    optimizer: OptimizerSpec  # run/engines.py
    zero: ZeroSpec  # run/engines.py: ZeRO's buckets, persistence threshold, overlap of communication
    schedule: ScheduleSpec  # run/schedule.py (its steps come from the plan: RunSetup.schedule)
    checkpoint: CheckpointSpec  # run/checkpoint.py: saves, resume, export, bad steps
    outputs: OutputSpec  # run/metrics.py: the run folder, metrics, bars, monitors
    settings: dict  # the flags as they run (each auto resolved, the DeepSpeed config's values taken): run_config.json

    @property
    def row_layout(self) -> RowLayout:
        return self.plan.config.layout


# ----------------------------------------------------------------------------- the flags, section by section
def lora_settings(flags: TrainConfig) -> LoraSettings | None:
    """--lora-*; None for full fine-tuning (--lora-r 0)."""
    if not flags.lora_r:
        return None
    alpha = flags.lora_alpha if flags.lora_alpha is not None else 2.0 * flags.lora_r
    return LoraSettings(flags.lora_r, alpha, flags.lora_dropout, flags.lora_target_modules)


def model_spec(flags: TrainConfig, dtype: str, device_type: str) -> ModelSpec:
    return ModelSpec(path=flags.model, config=flags.model_config, reference=flags.ref_model, revision=flags.revision,
                     trust_remote_code=flags.trust_remote_code, dtype=dtype, seed=flags.seed,
                     lora=lora_settings(flags), gradient_checkpointing=flags.gradient_checkpointing,
                     compile_layers=flags.compile_layers, liger_kernels=liger_kernels(flags, device_type))


def liger_kernels(flags: TrainConfig, device_type: str) -> bool:
    """--liger-kernels where its kernels run; off a GPU torch's layers, said once; on one without the package, no."""
    why = liger_obstacle(device_type) if flags.liger_kernels else None
    if why and device_type == "cuda":
        raise InputError(f"--liger-kernels: {why}")
    if why:
        say_warning(f"--liger-kernels: {why}: the model keeps torch's norms, SwiGLU and rotary")
    return flags.liger_kernels and why is None


def ref_sync(flags: TrainConfig) -> RefSync | None:
    return RefSync(flags.ref_model_mixup_alpha, flags.ref_model_sync_steps) if flags.sync_ref_model else None


def reference_spec(flags: TrainConfig, model: ModelSpec, loss: LossConfig, evaluation: EvalSpec) -> ReferenceSpec:
    return ReferenceSpec(logps_file=flags.ref_logps, offload=flags.ref_offload, sync=ref_sync(flags),
                         whole=flags.ref_whole, lora=model.lora is not None, separate_model=model.reference is not None,
                         loss=loss, held_out_dataset=evaluation.dataset is not None)


def optimizer_spec(flags: TrainConfig) -> OptimizerSpec:
    return OptimizerSpec(name=flags.optimizer, lr=flags.lr, betas=(flags.adam_beta1, flags.adam_beta2),
                         eps=flags.adam_epsilon, weight_decay=flags.weight_decay, max_grad_norm=flags.max_grad_norm)


def zero_spec(flags: TrainConfig) -> ZeroSpec:
    return ZeroSpec(prefetch_bucket_size=flags.zero_prefetch_bucket_size,
                    param_persistence_threshold=flags.zero_param_persistence_threshold,
                    reduce_bucket_size=flags.zero_reduce_bucket_size, overlap_comm=flags.zero_overlap_comm)


def schedule_spec(flags: TrainConfig) -> ScheduleSpec:
    return ScheduleSpec(kind=flags.lr_scheduler, warmup_steps=flags.warmup_steps, warmup_ratio=flags.warmup_ratio,
                        min_lr_ratio=flags.min_lr_ratio)


def checkpoint_spec(flags: TrainConfig) -> CheckpointSpec:
    output_dir = Path(flags.output_dir)
    return CheckpointSpec(output_dir=output_dir,
                          save_dir=Path(flags.save_dir) if flags.save_dir else output_dir / "checkpoints",
                          save_dir_named=bool(flags.save_dir), save_steps=flags.save_steps,
                          total_limit=flags.save_total_limit, resume=flags.resume,
                          allow_new_layout=flags.allow_new_layout, overwrite=flags.overwrite,
                          export_on_end=flags.export_on_end, max_shard_size=flags.max_shard_size,
                          max_bad_steps=flags.max_bad_steps)


def output_spec(flags: TrainConfig) -> OutputSpec:
    output_dir = Path(flags.output_dir)
    return OutputSpec(output_dir=output_dir,
                      metrics_path=Path(flags.metrics_out) if flags.metrics_out else output_dir / "metrics.jsonl",
                      overwrite=flags.overwrite, progress=flags.progress, logging_steps=flags.logging_steps,
                      verbose=flags.verbose, monitors=monitor_names(flags.report_to),
                      run_name=flags.run_name or output_dir.resolve().name, project=flags.project,
                      peak_tflops=flags.peak_tflops, profile_steps=flags.profile_steps)


def logps_chunk(flags: TrainConfig) -> int | str:
    """--logps-chunk-tokens as the log-prob stage takes it: a number of tokens, or "auto"."""
    return flags.logps_chunk_tokens if flags.logps_chunk_tokens == "auto" else int(flags.logps_chunk_tokens)


def with_ds_values(flags: TrainConfig, raw: dict, source: str, dp_size: int) -> tuple[TrainConfig, dict]:
    """(the flags with the values the DeepSpeed config writes, counted as written; the config with "auto" in their
    places): run/user_values.py's rule, the merged flags checked again as typed ones are."""
    values, keys, raw = take_user_values(to_dict(flags), flags.given, raw, source, dp_size)
    if not values:
        return flags, raw
    flags = dataclasses.replace(flags, **values, given=flags.given | set(values))
    try:
        flags.validate()
    except InputError as error:
        raise InputError(f"--ds-config {source}: {error} (after taking {', '.join(keys.values())} from it)") \
            from None
    return flags, raw


# ----------------------------------------------------------------------------- phase one
@dataclass
class RunSetup:
    """What phase one hands to phase two: the run's settings and what they were checked against (data, plan,
    DeepSpeed config, resume point, reference file)."""

    spec: RunSpec
    ds_config: dict
    tokenizer: object
    prepared: PreparedPairs  # the pairs the run trains on (or computes the reference of)
    schedule: Schedule  # the LR schedule over the run's total steps
    length: RunLength  # the epochs planned and the steps run (--epochs, --max-steps)
    resume: ResumePoint | None = None  # None: a fresh start
    precomputed: PrecomputedReference | None = None  # the --ref-logps file
    held_out: HeldOut | None = None  # the evaluation's pairs, plan and precomputed reference

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def pad_token_id(self) -> int:
        return pad_token_id(self.tokenizer)

    @property
    def plan_fingerprint(self) -> str:
        """What decides which pairs make up each step (a resume must match it: run/checkpoint.py)."""
        return plan_fingerprint(self.spec.plan.config, self.spec.evaluation.fraction, self.prepared.fingerprint)


def check_output_dir(checkpoint: CheckpointSpec, inputs: list[str]) -> None:
    """A training run writes into an empty folder, its own folder when it resumes, or any with --overwrite; its
    export replaces none of its ``inputs`` nor its own checkpoints."""
    out = checkpoint.output_dir
    if out.exists() and not out.is_dir():
        raise InputError(f"--output-dir {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not checkpoint.overwrite and not resumes_in_place(checkpoint):
        if checkpoint.resume:
            raise InputError(f"--output-dir {out}: folder is not empty and holds no checkpoint of this run to "
                             "resume; pass --overwrite to write into it")
        raise InputError(f"--output-dir {out}: folder is not empty (pass --overwrite to write into it, or "
                         "--resume auto to continue the run saved there)")
    if not checkpoint.export_on_end:
        return
    # round two from round one's export: its model, the reference too, replaced at the end
    check_not_an_input(checkpoint.export_dir, "--export-on-end", inputs)
    if replaces(checkpoint.export_dir, checkpoint.save_dir):  # else said at the end, after the training
        raise InputError(f"--save-dir {checkpoint.save_dir}: inside {checkpoint.export_dir}, which --export-on-end "
                         f"replaces with the model exported from it; save elsewhere")


def settle_row_layout(requested: RowLayout, written: bool, attn: str, layout: ParallelLayout, device_type: str,
                      dtype: str, command: str) -> RowLayout:
    """The run's row layout: the one the flags ask for, or packing alone where the backend cannot share prefixes.
    Prefix sharing is on by default for packed runs: that default gives way with a one-line warning, a written
    --prefix-sharing is refused (``written``), and ``check`` checks packing alone."""
    why = prefix_sharing_obstacle(attn, layout.sp_size, device_type, dtype) if requested.shares_prefixes else None
    if why is None:
        return requested
    if command == "check":
        return RowLayout.PACKED
    if not written:
        say_warning(f"--attn {attn}: prefix sharing off ({why}); every prompt runs twice")
        return RowLayout.PACKED
    able = prefix_sharing_backends()
    raise InputError(f"--attn {attn}: prefix sharing (on by default for packed runs) needs --attn auto, "
                     f"{', '.join(able[:-1])} or {able[-1]} ({why}); add --no-prefix-sharing to run {attn}")


def check_layout_settings(model: ModelSpec, layout: ParallelLayout, attn: str, row_layout: RowLayout,
                          hf_config) -> None:
    """What a sequence-parallel layout needs of the settings and the model, before any weights exist."""
    if layout.sp_size == 1:
        return
    check_attention(attn, layout.sp_size)
    if not row_layout.packed:
        raise InputError(f"--sequence-parallel-size {layout.sp_size} splits packed rows; it cannot be combined with "
                         f"--no-packing")
    check_model_heads(hf_config, layout.sp_size, model.source)


def check_models(model: ModelSpec, layout: ParallelLayout, attn: str, row_layout: RowLayout, vocab_size: int,
                 own_tokenizer: bool):
    """Phase one's look at the models' configs (no weights): the backend honours every attention feature of the
    policy and the reference (sliding windows, soft-caps, ...), the layout fits their heads, the LoRA adapters fit;
    a mixture-of-experts router loss is named as excluded.  Returns the policy's HF config."""
    hf_config = model_config(model, vocab_size, own_tokenizer)
    # Under sequence parallelism the model's attention is Ulysses around the local kernel: the per-sequence kernel
    # of sdpa_varlen for sdpa too, or a varlen kernel (flash-attn's, torch's).
    kernel = (BACKENDS[attn].ulysses_local or attn) if layout.sp_size > 1 else attn
    check_model_attention(hf_config, kernel, model.source)
    if model.reference is not None:
        check_model_attention(reference_model_config(model, vocab_size), kernel, f"--ref-model {model.reference}")
    check_layout_settings(model, layout, attn, row_layout, hf_config)
    if getattr(hf_config, "output_router_logits", False):
        # DPO's loss is a sum over pairs; a router load-balancing loss is one per packed row (over all its
        # tokens), which would make the loss depend on how pairs are packed (invariant 2).
        say_warning(f"{model.source}: the mixture-of-experts router auxiliary loss (output_router_logits, "
                    f"router_aux_loss_coef {getattr(hf_config, 'router_aux_loss_coef', None)}) is not added to the "
                    f"DPO loss")
    if model.lora is not None:  # the adapters fit the model (placed on its skeleton, with no weights)
        check_adapters(model.lora, hf_config, model.source, model.trust_remote_code)
    return hf_config


def check_evaluation_models(model: ModelSpec, reference: ReferenceSpec, loss: LossConfig) -> None:
    """``eval`` compares a trained policy (--model) with the model it was trained from: without that reference every
    reward would be 0 (SimPO needs none)."""
    if model.path is None:
        raise InputError("eval: --model is required (the trained or exported Hugging Face folder to evaluate)")
    if model.reference is None and reference.logps_file is None and loss.needs_reference:
        raise InputError("eval: --ref-model (the model the policy was trained from) or --ref-logps is required: with "
                         "--model as its own reference every reward is 0")


def prepare(flags: TrainConfig, command: str = "train", world_size: int | None = None,
            dry_run: bool = False) -> RunSetup:
    """Phase one: the flags resolved into the run's settings, and every check that needs no process group.

    ``world_size`` is the launch's when called before launching (the front command);
    under a launcher the layout comes from its environment.  ``check`` runs in one
    process.  ``dry_run`` (``train --dry-run``) leaves a checkpoint resumed at another layout unconverted.
    """
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}")
    quiet_libraries(flags.verbose)
    device_type = get_accelerator().device_name()
    raw_ds, ds_source = load_ds_config(flags.ds_config)
    layout = ParallelLayout.from_launch(flags.sequence_parallel_size, zero_stage(raw_ds),
                                        world_size=1 if command == "check" else world_size)
    flags, raw_ds = with_ds_values(flags, raw_ds, ds_source, layout.dp_size)
    check_adam_settings(flags.optimizer, flags.given)
    dtype = resolve_dtype(flags.dtype, device_type)
    attn = resolve_attn(flags.attn, device_type, needs_backward=command in TRAINING_COMMANDS, dtype=dtype)
    loss = flags.loss_config()
    data = flags.data_spec()
    evaluation = flags.evaluation_spec(data.tokenization)
    model = model_spec(flags, dtype, device_type)
    reference = reference_spec(flags, model, loss, evaluation)
    optimizer, schedule, outputs = optimizer_spec(flags), schedule_spec(flags), output_spec(flags)
    checkpoint = checkpoint_spec(flags)
    if command == "train":
        check_output_dir(checkpoint, flags.local_inputs())
        shard_size_bytes(checkpoint.max_shard_size)  # --export-on-end's, refused before any work
    if command == "eval":
        check_evaluation_models(model, reference, loss)
    row_layout = settle_row_layout(flags.row_layout, flags.is_given("prefix_sharing"), attn, layout, device_type,
                                   dtype, command)
    tokenizer, rows = tokenizer_and_rows(data)
    hf_config = check_models(model, layout, attn, row_layout, len(tokenizer), own_tokenizer=data.tokenizer is None)
    check_sync_settings(reference.sync, model, command, raw_ds, hf_config, len(tokenizer))
    logps = LogpsSpec(resolve_logps_impl(flags.logps_impl, device_type,
                                         getattr(hf_config, "final_logit_softcapping", None),
                                         model.lora is not None and model.lora.adapts_head), logps_chunk(flags))
    gave_way = row_layout is not flags.row_layout and command != "check"  # the settings say the default gave way
    settings = to_dict(dataclasses.replace(flags, dtype=dtype, logps_impl=logps.impl,
                                           prefix_sharing=flags.prefix_sharing and not gave_way))
    backend = BACKENDS[attn]
    spec = RunSpec(command, device_type, layout, flags.collective_timeout_s, model, reference, data, evaluation,
                   flags.plan_spec(layout, row_layout), loss,
                   AttentionSpec(attn, backend.model_implementation(layout.sp_size, row_layout.shares_prefixes),
                                 packing_check=not flags.skip_packing_check),
                   logps, optimizer, zero_spec(flags), schedule, checkpoint, outputs, settings)
    return checked_setup(spec, raw_ds, ds_source, tokenizer, rows, hf_config, dry_run)


def checked_setup(spec: RunSpec, raw_ds: dict, ds_source: str, tokenizer, rows: list[dict] | None, hf_config,
                  dry_run: bool) -> RunSetup:
    """The rest of phase one, from the run's settings: its data and plan, the LR schedule over the plan's steps, the
    filled DeepSpeed config, the resume point, the precomputed reference, the held-out set."""
    command, layout = spec.command, spec.layout
    prepared = prepare_run_data(spec.data.tokenization, tokenizer, rows)
    held_out = None
    if command in EVALUATING_COMMANDS:
        prepared, held_out = split_held_out(spec.evaluation, tokenizer, prepared)
    if command == "eval" and held_out is None:  # no held-out part named: evaluate on --dataset (--max-pairs) itself
        held_out = prepared
    checked_plan_config(spec.plan, layout.sp_size, prepared)
    length = run_length(spec.plan, prepared)
    schedule = spec.schedule.over(spec.optimizer.lr, length.steps)
    ds_config = fill_ds_config(raw_ds, ds_source, spec.optimizer, spec.model.dtype, spec.outputs, layout,
                               int(getattr(hf_config, "hidden_size", 1024)), spec.device_type, schedule, spec.zero)
    if spec.reference.offload:  # the reference's own config, so that a stage without parameter offload ends here
        reference_ds_config(ds_config, offload=True, source=ds_source)
    setup = RunSetup(spec, ds_config, tokenizer, prepared, schedule, length)
    if command == "train":
        setup.resume = check_resume(spec.checkpoint, setup.plan_fingerprint, layout, spec.model, spec.reference.sync)
        if setup.resume is not None and setup.resume.universal and not dry_run:
            if layout.rank == 0:  # once, before any process group: the other ranks wait for rank 0 to start it
                ensure_universal(setup.resume.tag_dir, setup.resume.global_step)
            setup.ds_config = with_universal_loading(setup.ds_config)
    if command in EVALUATING_COMMANDS:
        setup.precomputed = load_precomputed_reference(setup)
    if held_out is not None:
        setup.held_out = held_out_set(setup, held_out)
    return setup


# ----------------------------------------------------------------------------- phase two
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

    def _forward(self, model, batch: ModelBatch, attn: str, chunk_tokens: int | str = AUTO_CHUNK, impl: str = LEAN,
                 weighting: TokenWeighting | None = None):
        """One forward's per-sequence log-probs; under sequence parallelism each rank runs its slice."""
        if self.sequence_parallel is not None:
            return self.sequence_parallel.forward_logps(model, batch, attn, chunk_tokens, impl, weighting)
        return forward_logps(model, batch, attn, chunk_tokens, impl, weighting)

    def forward_logps(self, model, batch: ModelBatch, policy: bool = True) -> SequenceLogps:
        """The per-sequence log-probs the loss takes (LD-weighted with --ld-alpha; the policy's with WPO's
        statistic under --use-weighting)."""
        spec = self.setup.spec
        return self._forward(model, batch, spec.attention.model_attn, spec.logps.chunk_tokens, spec.logps.impl,
                             spec.loss.token_weighting(policy))

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
        """The model inputs of one planned row of ``plan`` (a StepPlan), collated in the step's row layout (the run's,
        or spread responses where the plan spread the step's prompt groups over ranks), on this rank's device."""
        setup = self.setup
        layout = plan.row_layout(setup.spec.row_layout)
        return collate_row(setup.prepared.dataset, row.pairs, setup.pad_token_id, layout, plan.responses,
                           row.responses).to(self.device)

    def check_packing(self) -> None:
        """The start-up guard (packed runs): packed log-probs, in the run's layout (prefix-shared or not), equal each
        sequence alone (eager), on every rank together."""
        model = self.policy if self.policy is not None else self.reference
        spec = self.setup.spec
        self.packing_check = assert_packing_exact(model, spec.attention.model_attn, self.setup.vocab_size,
                                                  self.setup.pad_token_id, device=self.device, forward=self._forward,
                                                  shared_prefix=spec.row_layout.shares_prefixes)

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
    spec = setup.spec
    layout, model, attn = spec.layout, spec.model, spec.attention.model_attn
    init_process_group(layout, spec.collective_timeout_s, quiet=not spec.outputs.verbose)
    sequence_parallel = mpu = None
    if layout.sp_size > 1:
        sequence_parallel, mpu = init_sequence_parallel(layout, spec.attention.backend, setup.pad_token_id)
    policy = None
    if spec.command in TRAINING_COMMANDS:
        policy = build_policy(model, spec.optimizer.weight_decay, setup.ds_config, setup.vocab_size, attn, mpu)
        if layout.rank == 0:
            print(trainable_line(policy.module, model.lora), flush=True)
    elif spec.command == "eval":
        policy = build_evaluated_policy(model, setup.ds_config, setup.vocab_size, attn, mpu)
    if setup.precomputed is not None:
        reference = setup.precomputed
    elif spec.command in EVALUATING_COMMANDS and not spec.loss.needs_reference:
        reference = None  # reference-free
    elif spec.command in TRAINING_COMMANDS and model.lora is not None and model.reference is None:
        reference = AdaptersOff()  # no second model: the base weights are the policy's own, frozen
    else:
        reference = build_reference(model, spec.reference.offload, spec.reference.whole, setup.ds_config,
                                    setup.vocab_size, attn, mpu)
    run = Run(setup, policy, reference, sequence_parallel)
    if spec.row_layout.packed and spec.attention.packing_check:
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
    spec = setup.spec
    model = load_model(spec.model, spec.model.path, setup.vocab_size, spec.attention.model_attn)
    return model.to(get_accelerator().current_device_name())
