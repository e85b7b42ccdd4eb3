"""The flags: one flat dataclass of everything users type, one place that turns it into command-line flags.

Every setting is a field of :class:`TrainConfig`; its metadata carries the help
text, so the argparse parser, the JSON or YAML config file (``--config FILE``) and the
documentation of the flags can never drift apart.  What is judged on the flags as typed
happens here, in every command, in milliseconds: each value's type, choice and range
(:data:`RANGES`), a setting written without the flag that turns it on, the folders a run
makes.  The flags are then resolved once, by ``run/assemble.py``, into the run's settings
(``assemble.RunSpec``), a tree of sections each defined beside the component that owns
it and checking how its own values fit together; the sections of the data floor and the
loss's, which the commands without a model (prepare, pack-stats) read or check too, are
built here.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .data.heldout import EvalSpec
from .data.plan import PlanConfig, RowLayout
from .data.multi_response import PAIRS_FROM
from .data.formats import FORMATS
from .data.prepare import DataConfig
from .data.run_plan import PlanSpec
from .console import say_warning
from .errors import InputError
from .files import check_creatable_folder, check_not_an_input

DTYPES = ("auto", "fp32", "bf16")
LR_SCHEDULERS = ("constant", "linear", "cosine")
LARGEST_COUNT = 2**31 - 1  # token counts, steps and sizes end in int32 tensors and indices
LARGEST_SEED = 2**32 - 1  # numpy's seeds


def _opt(help_text: str, default=None, choices=None, **meta):
    return field(default=default, metadata={"help": help_text, "choices": choices, **meta})


DEFAULT_GLOBAL_BATCH_PAIRS = 64  # pairs per step when neither --global-batch-pairs nor --tokens-per-step is given


@dataclass(frozen=True)
class Range:
    """The values a numeric flag takes: from ``low`` (``low_open``: excluded) up to ``high`` (None: no bound;
    ``high_open``: excluded); ``note`` follows the bounds in the refusal."""

    low: float
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""

    def holds(self, value) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low}{self.note}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}{self.note}"


AT_LEAST_0, AT_LEAST_1, ABOVE_0 = Range(0), Range(1), Range(0, low_open=True)
FRACTION = Range(0, 1, high_open=True)  # [0, 1)
# Each numeric flag's values: a value outside is refused in every command, before any work (its consumer would fail,
# or do nothing sensible).  The loss's settings are the loss registry's (model/loss_registry.py: LossConfig.validate);
# flags not named take any finite value up to LARGEST_COUNT.
RANGES: dict[str, Range] = {
    **dict.fromkeys(("weight_decay", "max_grad_norm", "warmup_steps", "adam_epsilon", "attention_weight",
                     "zero_prefetch_bucket_size", "zero_param_persistence_threshold"), AT_LEAST_0),
    **dict.fromkeys(("max_length", "synthetic_pairs", "micro_batch_pairs", "epochs",
                     "sequence_parallel_size", "logging_steps", "max_tokens_per_row", "global_batch_pairs",
                     "tokens_per_step", "max_steps", "max_prompt_length", "max_pairs", "eval_steps", "eval_max_pairs",
                     "save_steps", "save_total_limit", "max_bad_steps", "ref_model_sync_steps", "profile_steps",
                     "zero_reduce_bucket_size"),
                    AT_LEAST_1),
    **dict.fromkeys(("peak_tflops", "collective_timeout_s", "lora_alpha"), ABOVE_0),
    **dict.fromkeys(("adam_beta1", "adam_beta2", "warmup_ratio", "min_lr_ratio", "lora_dropout"), FRACTION),
    "seed": Range(0, LARGEST_SEED, note=" (numpy's seeds)"),
    "stop_grace_s": Range(0, low_open=True, note=" seconds"),
    "lora_r": Range(0, note=" (0: full fine-tuning)"),
    "tokenize_procs": Range(0, note=" (0: one per 50,000 pairs, up to the cores)"),
    "ref_model_mixup_alpha": Range(0, 1),
    "eval_fraction": Range(0, 1, low_open=True, high_open=True),
}

@dataclass
class TrainConfig:
    # --- model ---
    model: str | None = _opt("HF causal LM for the policy (and the reference unless --ref-model): a local folder or a "
                             "hub id (downloaded into the usual hub cache; HF_HUB_OFFLINE=1 reads only the cache).")
    model_config: str | None = _opt(
        "Build the model from a config with random weights: 'tiny', 'tiny-qwen2', 'tiny-ARCH' of the architecture "
        "matrix (e.g. tiny-mistral, tiny-gemma3) or a config.json path. "
        "Default 'tiny' when neither --model nor --model-config is given."
    )
    ref_model: str | None = _opt("Separate frozen reference model: a local HF folder or a hub id (its default "
                                 "revision).")
    # --- precomputed reference (ds-packdpo precompute-ref) ---
    ref_logps: str | None = _opt("Reference log-probs precomputed by 'ds-packdpo precompute-ref' (a .jsonl/.parquet "
                                 "file): train with no reference model at all.")
    # --- TR-DPO (TRL's sync_ref_model): the reference mixed toward the policy, run/reference_sync.py ---
    sync_ref_model: bool = _opt("TR-DPO: after every --ref-model-sync-steps-th optimizer step mix the reference toward "
                                "the policy, ref = alpha x policy + (1 - alpha) x ref, parameter by parameter (under "
                                "ZeRO-3 each rank its own partitions); checkpoints hold the mixed reference. Not with "
                                "LoRA, --ref-logps or --loss simpo.", False)
    ref_model_mixup_alpha: float = _opt("TR-DPO's alpha in [0, 1]: the policy's share of the mixed reference (needs "
                                        "--sync-ref-model).", 0.6)
    ref_model_sync_steps: int = _opt("TR-DPO: mix the reference after every N-th optimizer step (needs "
                                     "--sync-ref-model).", 512)
    tokenizer: str | None = _opt("HF tokenizer: a local folder or a hub id. Default: --model (at --revision), or a local "
                                 "BPE built for the embedded dataset.")
    revision: str | None = _opt("Hub revision (branch, tag or commit) of a hub --model and of the tokenizer taken from "
                                "it.")
    dtype: str = _opt("Precision: auto (bf16 on CUDA, fp32 on CPU), fp32 or bf16. Flash attention runs bf16 only.",
                      "auto", DTYPES)
    attn: str = _opt("Attention backend: auto (flash-attn, else torch_varlen on CUDA in bf16; sdpa_varlen on CPU and in "
                     "fp32), sdpa_varlen, torch_varlen, sdpa, eager, flex_attention, flash_attention_2, "
                     "flash_attention_3.", "auto")
    trust_remote_code: bool = _opt("Allow custom modelling code from model folders (off by default).", False)
    # --- LoRA (peft: pip install -e '.[lora]') ---
    lora_r: int = _opt("LoRA rank: train low-rank adapters on the frozen (ZeRO-sharded) base weights; the reference is "
                       "then the policy with its adapters switched off, unless --ref-model or --ref-logps. 0 trains "
                       "every weight.", 0)
    lora_alpha: float | None = _opt("LoRA scaling: the adapters' update is alpha / r x B A. Default 2 x --lora-r.")
    lora_dropout: float = _opt("Dropout on the LoRA adapters' input.", 0.0)
    lora_target_modules: str = _opt("Modules that get LoRA adapters: comma-separated names (a module matches when its "
                                    "name is one or ends with '.' + one, e.g. q_proj,v_proj,lm_head), or 'all-linear': "
                                    "every linear layer but the lm_head (the decoder layers' projections).",
                                    "all-linear")
    # --- data ---
    dataset: str | None = _opt("Preference data: a .json/.jsonl/.parquet/.arrow file, a save_to_disk folder or a hub name. "
                               "Default: the embedded synthetic dataset.")
    synthetic_pairs: int = _opt("Number of pairs of the embedded synthetic dataset.", 1024)
    format: str = _opt("Dataset format (auto-detected by default); completions, scored and ranked hold several "
                       "responses per prompt.", "auto", FORMATS)
    pairs_from: str = _opt("Pairs of a row with several scored or ranked responses: the best against the worst, the "
                           "best against each other one, or all (every two with different scores); ties are dropped "
                           "and counted.", "best-vs-worst", PAIRS_FROM)
    split: str = _opt("Dataset split.", "train")
    prompt_column: str = _opt("Column holding the prompt.", "prompt")
    chosen_column: str = _opt("Column holding the chosen completion.", "chosen")
    rejected_column: str = _opt("Column holding the rejected completion.", "rejected")
    conversations_column: str = _opt("Column holding ShareGPT conversations.", "conversations")
    max_length: int = _opt("Maximum tokens per sequence (prompt + completion).", 1024)
    max_prompt_length: int | None = _opt("Maximum prompt tokens (the prompt is cut from the left).")
    max_pairs: int | None = _opt("Use only the first N valid pairs of the dataset.")
    on_bad_row: str = _opt("What to do with a malformed dataset row.", "error", ("error", "skip"))
    tokenize_procs: int = _opt("Processes for tokenization (datasets' num_proc; not --num-procs, the ranks); 0: one "
                               "per 50,000 pairs, up to the cores this process may use (at most 8; 1 inside a rank).",
                               0)
    cache_dir: str | None = _opt("Tokenization cache folder (default ~/.cache/ds_packdpo).")
    # --- plan ---
    max_tokens_per_row: int | None = _opt(
        "Row budget in tokens. Default auto: max(2 x --max-length, 2 x --micro-batch-pairs x --max-length), what a "
        "padded micro-batch holds, so packing never runs more forwards per step, nor needs more activation memory, "
        "than padding would.")
    global_batch_pairs: int | None = _opt("Pairs per optimizer step, over all ranks (default 64 unless --tokens-per-step).")
    tokens_per_step: int | None = _opt("Alternative to --global-batch-pairs: close a step once its pairs hold this many tokens.")
    micro_batch_pairs: int = _opt("Pairs per padded micro-batch (with --no-packing).", 4)
    packing: bool = _opt("Pack pairs padding-free into rows (the default); --no-packing trains on padded micro-batches "
                         "instead (the baseline).", True)
    prefix_sharing: bool = _opt("Packed rows lay out each pair as [prompt | chosen | rejected], computing its prompt once "
                                "for both completions (exact: checked at start-up; needs --attn auto, sdpa_varlen or "
                                "flash_attention_2/3, or sequence parallelism); --no-prefix-sharing runs every prompt "
                                "twice. Only packed rows share prefixes.", True)
    prompt_groups: bool = _opt("With prefix sharing, the pairs of a step whose prompts are the same token ids run as "
                               "groups [prompt | r1 | ... | rk]: every distinct response computed once, the prompt once "
                               "per row holding one of them, the responses spread over ranks where that balances the "
                               "step (exact); --no-prompt-groups lays out each pair alone.", True)
    drop_last: bool = _opt("Drop the last incomplete step of every epoch.", False)
    attention_weight: float = _opt("Balance ranks on tokens + W * sum of squared sequence lengths.", 0.0)
    epochs: int = _opt("Passes over the data. Left out, as many as --max-steps needs (default 1).", 1)
    max_steps: int | None = _opt("Stop after this many optimizer steps. Without --epochs it runs them all, passing "
                                 "over the data again when one pass holds fewer; with --epochs, at most the steps of "
                                 "those epochs (the plan line says when they cap it).")
    seed: int = _opt("Seed for the plan, the model init and everything random.", 0)
    # --- optimisation and loss ---
    optimizer: str = _opt("Optimizer: a DeepSpeed optimizer (AdamW, Adam, Lamb, Lion, ...) or a torch.optim class name "
                          "(e.g. SGD).", "AdamW")
    lr: float = _opt("Peak learning rate.", 1e-6)
    adam_beta1: float = _opt("Adam/AdamW beta1.", 0.9)
    adam_beta2: float = _opt("Adam/AdamW beta2.", 0.95)
    adam_epsilon: float = _opt("Adam/AdamW epsilon.", 1e-8)
    weight_decay: float = _opt("AdamW weight decay.", 0.0)
    warmup_steps: int = _opt("Linear warm-up steps of the LR schedule (the LR reaches --lr at step N).", 0)
    max_grad_norm: float = _opt("Gradient clipping (0 disables).", 1.0)
    loss: str = _opt("DPO-family loss, or several comma-separated (summed with --loss-weights): sigmoid, robust, "
                     "hinge, ipo, simpo, or any TRL 1.16 loss type (exo_pair, nca_pair, bco_pair, sppo_hard, aot, "
                     "aot_unpaired, apo_zero, apo_down, discopop, sft, sigmoid_norm).", "sigmoid")
    loss_weights: str | None = _opt("Comma-separated weight per --loss entry (same length); default 1 each.")
    f_divergence_type: str = _opt("TRL's f-divergence of the log-ratio scores.", "reverse_kl",
                                  ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"))
    f_alpha_divergence_coef: float = _opt("Alpha of --f-divergence-type alpha_divergence.", 1.0)
    discopop_tau: float = _opt("Temperature of the DiscoPOP mixing sigmoid.", 0.05)
    beta: float = _opt("DPO beta.", 0.1)
    label_smoothing: float = _opt("Conservative-DPO label smoothing.", 0.0)
    simpo_gamma: float = _opt("SimPO target margin.", 0.5)
    rpo_alpha: float = _opt("Weight of the NLL-per-chosen-token (RPO/SFT) term; 0 disables.", 0.0)
    ld_alpha: float | None = _opt("LD-DPO (TRL's ld_alpha, in [0, 1]): a completion's tokens past the shorter "
                                  "completion of its pair count with this weight in the policy's and the reference's "
                                  "log-probs; default off.")
    use_weighting: bool = _opt("WPO (TRL's use_weighting): each pair's loss times w(chosen) w(rejected), "
                               "w = exp(mean over the completion of log p_t - log sum_v p_v^2) of the policy, "
                               "without gradient.", False)
    logps_chunk_tokens: str = _opt("Completion tokens per chunk of the log-prob computation (with lean log-probs: "
                                   "the most tokens whose logits exist at once): a number, or 'auto', the largest "
                                   "chunk whose fp32 logits and gradient stay under half the stage's floor (the "
                                   "row's hidden states and the lm_head gradient).", "auto")
    logps_impl: str = _opt("Log-probs from chunks of the final hidden states, never the whole [tokens x vocab] logits "
                           "(lean); from a fused linear-cross-entropy kernel that never writes logits at all (fused: "
                           "cut-cross-entropy, CUDA, pip install -e '.[fused]'); or from the full logits (plain). "
                           "auto: fused where it is installed and the model allows it, else lean.", "auto",
                           ("auto", "lean", "fused", "plain"))
    # --- DeepSpeed ---
    ds_config: str = _opt("DeepSpeed config: a built-in name (zero3, zero3_offload, zero2: ds_configs/, shipped in the "
                          "package) or a JSON path.", "zero3")
    ref_offload: bool = _opt("Offload the reference parameters to CPU (ZeRO-3).", False)
    ref_whole: bool = _opt("Keep the reference's weights whole on every rank (ZeRO-3: each of its parameters persistent, "
                           "gathered once): its forward gathers and releases nothing, for its whole weights' memory "
                           "on every GPU. Under ZeRO 0-2 the reference is whole already.", False)
    # ZeRO's communication (run/engines.ZeroSpec): each also a key of --ds-config's zero_optimization, given once
    zero_prefetch_bucket_size: int | None = _opt(
        "ZeRO-3's stage3_prefetch_bucket_size: parameter elements gathered ahead of the layers that need them. "
        "Default: the DeepSpeed config's value, else 0.9 x hidden_size^2.")
    zero_param_persistence_threshold: int | None = _opt(
        "ZeRO-3's stage3_param_persistence_threshold: parameters of fewer elements stay whole on every rank (never "
        "gathered or released). Default: the DeepSpeed config's value, else 10 x hidden_size.")
    zero_reduce_bucket_size: int | None = _opt(
        "ZeRO's reduce_bucket_size: gradient elements reduced (scattered) together. Default: the DeepSpeed config's "
        "value, else hidden_size^2.")
    zero_overlap_comm: bool | None = _opt(
        "ZeRO's overlap_comm: reduce gradients while the backward runs (a side stream). Default: the DeepSpeed "
        "config's value, else DeepSpeed's (on for ZeRO-3).")
    collective_timeout_s: float = _opt("Seconds before a stalled collective (e.g. a dead rank) ends the run.", 600.0)
    skip_packing_check: bool = _opt("Skip the start-up check that packed log-probs equal unpacked ones.", False)
    # --- sequence parallelism ---
    sequence_parallel_size: int = _opt(
        "Split every packed row along its tokens over this many consecutive ranks (DeepSpeed-Ulysses attention, "
        "per-sequence log-probs all-reduced); the row budget becomes this x --max-tokens-per-row.", 1)
    # --- throughput (MFU in the per-step log and the bench) ---
    peak_tflops: float | None = _opt("Peak TFLOP/s of one device at the run's precision, for MFU (logged on GPU only; "
                                     "e.g. 989 for an H100 SXM in bf16).")
    profile_steps: int | None = _opt(
        "Run N optimizer steps (from the second) under torch.profiler and write OUTPUT_DIR/profile.json (the table "
        "also in profile.md): the step's device time by category (GEMMs, attention, the log-prob stage, elementwise, "
        "ZeRO-3 collectives, optimizer) with their FLOPs, and the time the device sat idle waiting for the host.")
    # --- outputs ---
    output_dir: str = _opt("Run folder (metrics, logs).", "runs/train")
    metrics_out: str | None = _opt("Per-step JSON lines (default OUTPUT_DIR/metrics.jsonl).")
    overwrite: bool = _opt("Allow writing into a non-empty output folder.", False)
    progress: bool = _opt("Show the progress bar on rank 0 (and the bars of tokenization, precompute-ref, eval and "
                          "bench); --no-progress prints none, and one line every --logging-steps steps instead.", True)
    logging_steps: int = _opt("With --no-progress, print a line of the step's figures every N optimizer steps.", 10)
    verbose: bool = _opt("Show libraries' warnings and DeepSpeed's INFO lines (the launcher's commands) and warnings.",
                         False)
    config: str | None = _opt("A JSON or YAML file of settings (keys are flag names; a run's own run_config.json "
                              "too); flags given on the command line win.")
    report_to: str | None = _opt("Report the per-step figures through DeepSpeed's monitors: a comma-separated list of "
                                 "tensorboard, wandb, csv, comet. Default: the monitor sections of --ds-config.")
    run_name: str | None = _opt("The run's name in the monitors (tensorboard and csv job name, wandb group, comet "
                                "experiment name). Default: the output folder's name.")
    project: str | None = _opt("The wandb or comet project of --report-to.")
    # --- checkpoints, resume, export, bad steps ---
    save_steps: int | None = _opt("Save a checkpoint every N optimizer steps and at the end (DeepSpeed, ZeRO shards).")
    save_dir: str | None = _opt("Checkpoint folder (default OUTPUT_DIR/checkpoints).")
    save_total_limit: int | None = _opt("Keep only the newest K checkpoints.")
    resume: str | None = _opt("'auto' (the latest complete checkpoint in --save-dir, or a fresh start when there is "
                              "none) or a checkpoint folder; continues the run exactly.")
    allow_new_layout: bool = _opt("Let --resume load a checkpoint written by another number of ranks (or data-/"
                                  "sequence-parallel split): it is converted once to DeepSpeed's universal format "
                                  "(kept in the checkpoint's folder) and loaded at this run's layout (ZeRO-3).", False)
    export_on_end: bool = _opt("At the end, write a Hugging Face folder (safetensors, config, tokenizer) to "
                               "OUTPUT_DIR/hf_model, in --dtype.", False)
    max_shard_size: str = _opt("Largest safetensors file of --export-on-end (e.g. 5GB, 500MB); a larger model is split "
                               "into several, with an index.", "5GB")
    stop_grace_s: float = _opt("On SIGTERM or SIGINT to 'ds-packdpo train' every rank stops at the next step boundary, "
                               "saves a checkpoint (with --save-steps or --save-dir) and exits 7; after this many "
                               "seconds the ranks still running are killed (Slurm kills at 30 s).", 20.0)
    max_bad_steps: int = _opt("A step with a NaN/inf loss or gradient is skipped; abort after this many in a row.", 3)
    # --- training at scale: activation checkpointing, LR schedule, held-out evaluation ---
    gradient_checkpointing: bool = _opt(
        "Recompute every decoder layer's activations in backward instead of keeping them (transformers' "
        "non-reentrant activation checkpointing): activation memory of one layer instead of all, for about one more "
        "forward per step. Puts the policy in training mode.", False)
    compile_layers: bool = _opt(
        "torch.compile each decoder layer's forward (inductor; regional: the layers share one graph, the token "
        "dimension dynamic so that rows of a new length do not recompile; attention and ZeRO-3's hooks stay "
        "eager): the same figures, faster where the GPU waits on many small kernels.", False)
    liger_kernels: bool = _opt(
        "liger-kernel's fused Triton RMSNorm, SwiGLU and rotary kernels in the model (CUDA, pip install -e "
        "'.[liger]'); on a CPU the model keeps torch's layers, with one warning.", False)
    lr_scheduler: str = _opt(
        "LR after the warm-up: constant, linear decay or cosine decay to --min-lr-ratio x --lr at the end of the run "
        "(DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR; the total steps come from the plan).", "linear",
        LR_SCHEDULERS)
    warmup_ratio: float | None = _opt("Warm-up steps as a fraction of the run's steps (rounded up), instead of "
                                      "--warmup-steps.")
    min_lr_ratio: float = _opt("The LR the linear and cosine schedules start the warm-up from and decay to, as a "
                               "fraction of --lr.", 0.0)
    eval_dataset: str | None = _opt("Held-out preference data for evaluation (any format --dataset accepts).")
    eval_fraction: float | None = _opt(
        "Hold out this fraction of --dataset for evaluation, chosen by pair content (a hash of its tokens): the same "
        "pairs whatever the seed, layout or order, never trained on.")
    eval_steps: int | None = _opt("Evaluate every N optimizer steps (always after the last one too).")
    eval_max_pairs: int | None = _opt("Evaluate on the first N held-out pairs only.")
    # Not a flag: the settings the user wrote (command line or --config), as opposed to defaults.  A value the
    # DeepSpeed config can give too runs from there when the flag was left at its default (run/user_values.py).
    given: frozenset = field(default=frozenset(), repr=False, compare=False, metadata={"flag": False})
    # Not a flag: the settings that came from the --config file and not from the command line (a recipe written for
    # training may hold settings another command does not act on: set_aside).
    from_file: frozenset = field(default=frozenset(), repr=False, compare=False, metadata={"flag": False})

    # ------------------------------------------------------------------
    def is_given(self, name: str) -> bool:
        """Whether the user wrote setting ``name`` (a field name) rather than leaving it at its default."""
        return name in self.given

    def local_inputs(self) -> list[str]:
        """The files and folders on this machine that the run reads: an output written over one would lose it."""
        paths = (self.dataset, self.eval_dataset, self.model, self.model_config, self.ref_model, self.ref_logps,
                 self.tokenizer, self.config, self.ds_config)
        return [path for path in paths if path and Path(path).expanduser().exists()]

    @property
    def row_layout(self) -> RowLayout:
        """The row layout the flags ask for (phase one may give way to what the attention backend runs)."""
        return RowLayout.of(self.packing, self.prefix_sharing, self.prompt_groups)

    # The sections that the commands without a model (prepare, pack-stats) read or check too: the data floor's and
    # the loss's; the run's other sections are resolved by run/assemble.py.
    def data_spec(self):
        """What the run reads: its dataset (the embedded synthetic set when none), tokenized how, and its
        tokenizer."""
        # Deferred import: data.source brings transformers (the tokenizers), which report, export and
        # verify-checkpoint never need.
        from .data.source import DataSpec

        tokenization = DataConfig(
            dataset=self.dataset or "synthetic", split=self.split, format=self.format,
            prompt_column=self.prompt_column, chosen_column=self.chosen_column, rejected_column=self.rejected_column,
            conversations_column=self.conversations_column, max_length=self.max_length,
            max_prompt_length=self.max_prompt_length, on_bad_row=self.on_bad_row, tokenize_procs=self.tokenize_procs,
            cache_dir=self.cache_dir, max_pairs=self.max_pairs, pairs_from=self.pairs_from, progress=self.progress)
        return DataSpec(tokenization, synthetic_pairs=self.synthetic_pairs if self.dataset is None else None,
                        tokenizer=self.tokenizer, model=self.model, revision=self.revision,
                        trust_remote_code=self.trust_remote_code)

    def evaluation_spec(self, tokenization: DataConfig) -> EvalSpec:
        """The held-out evaluation: a fraction of --dataset or --eval-dataset (tokenized like ``tokenization``),
        how many of its pairs, how often."""
        dataset = None
        if self.eval_dataset is not None:
            dataset = dataclasses.replace(tokenization, dataset=self.eval_dataset, max_pairs=self.eval_max_pairs)
        return EvalSpec(self.eval_fraction, dataset, self.eval_max_pairs, self.eval_steps)

    def loss_config(self, together: bool = True):
        """The loss settings (model.loss_registry.LossConfig), validated: every rule about a loss is there (not
        ``together``: each setting on its own, as the flags are parsed for any command)."""
        # Deferred import: the loss registry brings torch, which the settings alone do not need.
        from .model.loss_registry import LossConfig

        try:
            weights = None if self.loss_weights is None else tuple(float(w) for w in self.loss_weights.split(","))
        except ValueError:
            raise InputError(f"--loss-weights: {self.loss_weights!r} is not a comma-separated list of numbers") from None
        loss = LossConfig(loss_type=self.loss, beta=self.beta, label_smoothing=self.label_smoothing,
                          simpo_gamma=self.simpo_gamma, rpo_alpha=self.rpo_alpha, loss_weights=weights,
                          f_divergence_type=self.f_divergence_type,
                          f_alpha_divergence_coef=self.f_alpha_divergence_coef, discopop_tau=self.discopop_tau,
                          ld_alpha=self.ld_alpha, use_weighting=self.use_weighting)
        loss.validate(together)
        return loss

    def plan_spec(self, layout, row_layout: RowLayout) -> PlanSpec:
        """The plan of this run laid out as ``layout`` (a run.layout.ParallelLayout), its rows in ``row_layout``.

        The row budget is --max-tokens-per-row, or auto: the tokens of one padded micro-batch at --max-length.
        Under ZeRO-3 every forward all-gathers every layer, so a packed row smaller than a padded micro-batch
        costs forwards that padding would not run (seen: 0.6x padded tokens/s at 2 x max-length).  The plan
        deals every step over the data-parallel shares; under sequence parallelism a row is shared by the
        ``sp_size`` ranks of a group, so it holds ``sp_size`` x the per-rank budget.
        """
        budget = self.max_tokens_per_row or max(2 * self.max_length, 2 * self.micro_batch_pairs * self.max_length)
        by_pairs = self.global_batch_pairs
        if self.global_batch_pairs is None and self.tokens_per_step is None:
            by_pairs = DEFAULT_GLOBAL_BATCH_PAIRS
        config = PlanConfig(max_tokens_per_row=budget * layout.sp_size, dp_size=layout.dp_size, seed=self.seed,
                            global_batch_pairs=by_pairs, tokens_per_step=self.tokens_per_step,
                            drop_last=self.drop_last, attention_weight=self.attention_weight, layout=row_layout,
                            micro_batch_pairs=self.micro_batch_pairs)
        return PlanSpec(config, row_budget=budget, epochs=self.epochs, max_steps=self.max_steps,
                        epochs_given=self.is_given("epochs"))

    def validate(self, unused: frozenset[str] = frozenset()) -> None:
        """The flags as typed, in every command: each value's type, choice and range (:data:`RANGES`), a setting
        written without the flag that turns it on, and the folders a run makes (``unused``: settings the command
        sets aside).  How the values of one part of the run fit together is that part's own check (each section of
        the run's settings, built by run/assemble.py)."""
        for f in flag_fields(type(self)):
            value = getattr(self, f.name)
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise InputError(f"--{flag(f.name)}: {value!r} is not one of {', '.join(choices)}")
            if isinstance(value, float) and not math.isfinite(value):
                raise InputError(f"--{flag(f.name)} must be a finite number, got {value}")
            if isinstance(value, int) and not isinstance(value, bool) and value > LARGEST_COUNT and f.name != "seed":
                raise InputError(f"--{flag(f.name)} must be at most {LARGEST_COUNT}, got {value}")
            if value is not None and f.name in RANGES and not RANGES[f.name].holds(value):
                raise InputError(f"--{flag(f.name)} must be {RANGES[f.name]}, got {value}")
        if self.lr <= 0:  # (--beta > 0 is the loss settings' rule, checked below)
            raise InputError(f"--lr and --beta must be > 0, got lr={self.lr} beta={self.beta}")
        self.loss_config(together=False)
        if self.logps_chunk_tokens != "auto" and not (self.logps_chunk_tokens.isdigit() and int(self.logps_chunk_tokens)):
            raise InputError(f"--logps-chunk-tokens must be 'auto' or a number >= 1, got {self.logps_chunk_tokens!r}")
        if self.global_batch_pairs is not None and self.tokens_per_step is not None:
            raise InputError("--global-batch-pairs and --tokens-per-step are exclusive; give one")
        self._refuse_unused("lora_r", ("lora_alpha", "lora_dropout", "lora_target_modules"),
                            "without --lora-r: LoRA is off (give --lora-r R > 0)")
        self._refuse_unused("sync_ref_model", ("ref_model_mixup_alpha", "ref_model_sync_steps"),
                            "without --sync-ref-model has no effect (add --sync-ref-model)")
        for key in ("output_dir", "save_dir", "cache_dir"):  # folders the ranks make: the OS must let them
            if getattr(self, key) and key not in unused:  # eval's default runs/train is never made
                check_creatable_folder(getattr(self, key), f"--{flag(key)}")
        if self.metrics_out:
            check_not_an_input(self.metrics_out, "--metrics-out", self.local_inputs())
            check_creatable_folder(Path(self.metrics_out).parent, "--metrics-out")

    def _refuse_unused(self, enabling: str, names: tuple[str, ...], why: str) -> None:
        """Settings among ``names`` written away from their defaults while ``enabling`` is off: refused (``why``)."""
        if getattr(self, enabling):
            return
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        written = [f"--{flag(name)}" for name in names if getattr(self, name) != defaults[name]]
        if written:
            raise InputError(f"{', '.join(written)} {why}")


def resolve_dtype(dtype: str, device_type: str) -> str:
    """--dtype auto: bf16 on CUDA (flash attention runs half precision only), fp32 on CPU (no fast bf16 kernels)."""
    if dtype != "auto":
        return dtype
    return "bf16" if device_type == "cuda" else "fp32"


def flag(name: str) -> str:
    return name.replace("_", "-")


def flag_fields(config_cls=TrainConfig) -> list[dataclasses.Field]:
    """The fields that are settings (a flag each, a key of --config and of run_config.json)."""
    return [f for f in dataclasses.fields(config_cls) if f.metadata.get("flag", True)]


@functools.cache
def _type_hints(cls) -> dict:
    return typing.get_type_hints(cls)  # ~2 ms a call: once per field per parser made every parser cost 0.1 s


def _field_type(f: dataclasses.Field) -> type:
    tp = _type_hints(TrainConfig)[f.name]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


class FlagParser(argparse.ArgumentParser):
    """argparse taking whole flag names only (an abbreviation such as --max-len once ran as --max-length) whose errors
    are one line, naming the closest flag of a mistyped one, instead of the whole usage."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        flags = [option for action in self._actions for option in action.option_strings]
        hints = []
        if message.startswith("unrecognized arguments:"):
            for arg in message.split(":", 1)[1].split():
                close = difflib.get_close_matches(arg.split("=")[0], flags, n=1) if arg.startswith("--") else []
                hints += [f"{arg.split('=')[0]}: did you mean {close[0]}?"] if close else []
        self.exit(2, f"error: {self.prog}: {message}{'; ' if hints else ''}{'; '.join(hints)}\n")


# Settings renamed: the old name (a flag, a --config key) is refused with a pointer to the new one.
RENAMED = {"num_proc": ("tokenize_procs", "tokenization processes; --num-procs is the ranks a front command starts")}


def renamed(name: str) -> str:
    """The one-line pointer of a renamed setting (``name``: its old field name)."""
    new, what = RENAMED[name]
    return f"--{flag(name)} is now --{flag(new)} ({what})"


class _Renamed(argparse.Action):
    """An old flag: refused, pointing at its new name."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(renamed(self.dest))


def add_arguments(parser: argparse.ArgumentParser, config_cls=TrainConfig) -> None:
    """Adds one flag per field; defaults are None so a config file can fill what the command line left out."""
    for f in flag_fields(config_cls):
        tp = _field_type(f)
        kwargs = {"help": f.metadata.get("help"), "default": None, "dest": f.name}
        if tp is bool:
            parser.add_argument(f"--{flag(f.name)}", action=argparse.BooleanOptionalAction, **kwargs)
        else:
            if f.metadata.get("choices"):
                kwargs["choices"] = f.metadata["choices"]
            parser.add_argument(f"--{flag(f.name)}", type=tp, **kwargs)
    for old in RENAMED:
        parser.add_argument(f"--{flag(old)}", action=_Renamed, nargs="?", dest=old, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)
    # The deepspeed launcher appends --local_rank=N; the rank also lives in LOCAL_RANK.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


# Settings written as comma-separated lists, and their items' type: a --config file may give them as a list.
COMMA_LISTS = {"loss": str, "loss_weights": float, "lora_target_modules": str, "report_to": str}


def _comma_list(key: str, items: list, item_type: type, source: str) -> str:
    """A YAML/JSON list (``loss: [sigmoid, sft]``) as the flag's comma-separated text ("sigmoid,sft")."""
    def fits(item) -> bool:
        if item_type is float:
            return isinstance(item, (int, float)) and not isinstance(item, bool)
        return isinstance(item, str) and bool(item.strip())

    wrong = [item for item in items if not fits(item)]
    if wrong or not items:
        what = "numbers" if item_type is float else "names"
        got = f"{type(wrong[0]).__name__} {wrong[0]!r}" if wrong else "an empty list"
        raise InputError(f"{source}: key '{key}' must be a comma-separated string or a list of {what}, got {got}")
    return ",".join(str(item) for item in items)


def _coerce(key: str, value, tp: type, source: str):
    if value is None:
        return None
    if isinstance(value, list) and key.replace("-", "_") in COMMA_LISTS:
        return _comma_list(key, value, COMMA_LISTS[key.replace("-", "_")], source)
    if tp is bool and isinstance(value, bool):
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is str and isinstance(value, str):
        return value
    if tp is str and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # e.g. logps_chunk_tokens: a count or "auto"; the setting's validation judges the text
    raise InputError(f"{source}: key '{key}' must be {tp.__name__}, got {type(value).__name__} {value!r}")


@functools.cache
def _yaml_loader():
    """yaml.SafeLoader that also reads 1e-4 as a number: YAML 1.1, which PyYAML implements, needs a dot (1.0e-4)
    and would hand --lr the string '1e-4'."""
    import yaml  # deferred: only YAML files need it

    class Loader(yaml.SafeLoader):
        pass

    exponent = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", exponent, list("-+0123456789"))
    return Loader


def read_mapping(path: str, what: str) -> dict:
    """A JSON or YAML file (by its suffix: .yaml/.yml, else JSON) holding one mapping; ``what`` names the flag in
    errors."""
    file = Path(path)
    yaml_file = file.suffix.lower() in (".yaml", ".yml")
    kind = "YAML" if yaml_file else "JSON"
    try:
        text = file.read_text()
        if yaml_file:
            import yaml

            raw = yaml.load(text, Loader=_yaml_loader())  # a SafeLoader
        else:
            raw = json.loads(text)
    except (FileNotFoundError, IsADirectoryError):
        raise InputError(f"{what} {path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} {path}: not valid {kind} ({exc})") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{what} {path}: not valid JSON ({exc})") from None
    except Exception as exc:  # yaml.YAMLError; its message spans lines (the mark's context)
        if not yaml_file or type(exc).__module__.split(".")[0] != "yaml":
            raise
        raise InputError(f"{what} {path}: not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(raw, dict):
        raise InputError(f"{what} {path}: expected a {kind} mapping of settings, got {type(raw).__name__}")
    return raw


def load_config_file(path: str, config_cls=TrainConfig) -> dict:
    """Reads a JSON or YAML settings file; unknown keys and wrong types are errors naming the key.  A run's own
    run_config.json (whose 'config' names the file it was read from, if any) is accepted back."""
    raw = read_mapping(path, "--config")
    fields = {f.name: f for f in flag_fields(config_cls)}
    values = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name == "config" and value is None:
            continue  # run_config.json of an earlier version
        if name in RENAMED:
            raise InputError(f"--config {path}: key '{key}' is now '{RENAMED[name][0]}' ({RENAMED[name][1]})")
        if name not in fields or name == "config":
            close = difflib.get_close_matches(name, [known for known in fields if known != "config"], n=1)
            hint = ("; a settings file cannot name another" if name == "config"
                    else f"; did you mean '{close[0]}'?" if close else "")
            raise InputError(f"--config {path}: unknown key '{key}'{hint}")
        f = fields[name]
        values[name] = _coerce(key, value, _field_type(f), f"--config {path}")
        choices = f.metadata.get("choices")
        if choices and values[name] not in choices:
            raise InputError(f"--config {path}: key '{key}' must be one of {', '.join(choices)}, got {value!r}")
    return values


def config_from_args(args: argparse.Namespace, config_cls=TrainConfig, aside=()):
    """Merges defaults < config file < command line into a validated config that records which settings the user
    wrote (``given``).  ``aside``: (settings, why) of a command that does not act on them (command_settings.py),
    set aside before validation, so that a training recipe's value for them (a --ref-logps file precompute-ref is
    about to write) is not judged."""
    values = load_config_file(args.config, config_cls) if getattr(args, "config", None) else {}
    from_file = {k for k, v in values.items() if v is not None}
    for f in flag_fields(config_cls):
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name] = given
            from_file.discard(f.name)
    values = {k: v for k, v in values.items() if v is not None}  # a null in a file is the default
    cfg = config_cls(**values, given=frozenset(values), from_file=frozenset(from_file))
    for names, what in aside:
        cfg = set_aside(cfg, names, what)
    cfg.validate(unused=frozenset(name for names, _ in aside for name in names))
    return cfg


def set_aside(cfg: TrainConfig, names: tuple[str, ...], what: str) -> TrainConfig:
    """``cfg`` without the settings among ``names`` that a command does not act on (``what`` says why, after the
    flags).  Written on the command line, they are refused (the command would run without them); from a --config
    recipe, written for another command (a training recipe given to bench), they are set back to their defaults
    with one warning, so the recipe still runs."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    written = [name for name in names if getattr(cfg, name) != defaults[name]]
    typed = [name for name in written if name not in cfg.from_file]
    if typed:
        raise InputError(f"{', '.join('--' + flag(name) for name in typed)}: {what}; drop them")
    if not written:
        return cfg
    say_warning(f"{', '.join(written)} from --config {cfg.config}: {what}; set aside")
    return dataclasses.replace(cfg, **{name: defaults[name] for name in written},
                               given=cfg.given - set(written), from_file=cfg.from_file - set(written))


TRAIN_EPILOG = ("ds-packdpo train (outside a launcher) also takes --num-procs N (ranks to start), --master-port P and "
                "--dry-run (phase one only: the plan line and a per-GPU memory estimate; nothing starts, nothing is "
                "written).")


def train_parser(prog: str = "ds-packdpo train", description: str = "Packed, rank-balanced DPO on DeepSpeed.",
                 epilog: str | None = TRAIN_EPILOG) -> argparse.ArgumentParser:
    """The training flags under ``prog``; another command that takes them (eval) passes its own texts."""
    parser = FlagParser(prog=prog, description=description, epilog=epilog)
    add_arguments(parser)
    return parser


def parse_train_args(argv: list[str] | None = None, prog: str = "ds-packdpo train", aside=(), **texts) -> TrainConfig:
    return config_from_args(train_parser(prog, **texts).parse_args(argv), aside=aside)


def to_dict(cfg) -> dict:
    """The settings, as run_config.json holds them and --config reads them back: every value a --config file gave is
    among them, so the file's own name is not."""
    return {f.name: getattr(cfg, f.name) for f in flag_fields(type(cfg)) if f.name != "config"}
