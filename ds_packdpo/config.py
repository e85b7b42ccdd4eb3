"""Run settings: one dataclass, one place that turns it into command-line flags.

Every setting is a field of :class:`TrainConfig`; its metadata carries the help
text, so the argparse parser, the JSON config file (``--config FILE``) and the
documentation of the flags can never drift apart.  Validation that needs no
model, no data and no process group happens here, so an impossible
configuration fails in milliseconds with one line naming the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .data.plan import PlanConfig
from .data.multi_response import PAIRS_FROM
from .data.prepare import FORMATS, DataConfig
from .console import say_warning
from .errors import InputError
from .files import check_creatable_folder, check_not_an_input
from .hub import check_bare_name, check_model_source, is_hub_id

DTYPES = ("auto", "fp32", "bf16")
# --report-to's names -> the DeepSpeed config's monitor sections
MONITORS = {"tensorboard": "tensorboard", "wandb": "wandb", "csv": "csv_monitor", "comet": "comet"}
LR_SCHEDULERS = ("constant", "linear", "cosine")
LARGEST_COUNT = 2**31 - 1  # token counts, steps and sizes end in int32 tensors and indices
LARGEST_SEED = 2**32 - 1  # numpy's seeds


def _opt(help_text: str, default=None, choices=None, **meta):
    return field(default=default, metadata={"help": help_text, "choices": choices, **meta})


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
    num_proc: int = _opt("Processes for tokenization.", 1)
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
    epochs: int = _opt("Passes over the data.", 1)
    max_steps: int | None = _opt("Stop after this many optimizer steps.")
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
    collective_timeout_s: float = _opt("Seconds before a stalled collective (e.g. a dead rank) ends the run.", 600.0)
    skip_packing_check: bool = _opt("Skip the start-up check that packed log-probs equal unpacked ones.", False)
    # --- sequence parallelism ---
    sequence_parallel_size: int = _opt(
        "Split every packed row along its tokens over this many consecutive ranks (DeepSpeed-Ulysses attention, "
        "per-sequence log-probs all-reduced); the row budget becomes this x --max-tokens-per-row.", 1)
    # --- throughput (MFU in the per-step log and the bench) ---
    peak_tflops: float | None = _opt("Peak TFLOP/s of one device at the run's precision, for MFU (logged on GPU only; "
                                     "e.g. 989 for an H100 SXM in bf16).")
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
    @property
    def row_budget(self) -> int:
        """--max-tokens-per-row, or auto (None): the tokens of one padded micro-batch at --max-length.  Under
        ZeRO-3 every forward all-gathers every layer, so a packed row smaller than a padded micro-batch costs
        forwards that padding would not run (seen: 0.6x padded tokens/s at 2 x max-length)."""
        if self.max_tokens_per_row is not None:
            return self.max_tokens_per_row
        return max(2 * self.max_length, 2 * self.micro_batch_pairs * self.max_length)

    @property
    def shares_prefixes(self) -> bool:
        """Rows lay out each pair with its prompt once (packed runs with prefix sharing on)."""
        return self.packing and self.prefix_sharing

    @property
    def batch_pairs(self) -> int | None:
        if self.global_batch_pairs is None and self.tokens_per_step is None:
            return 64
        return self.global_batch_pairs

    @property
    def logps_chunk(self) -> int | str:
        """--logps-chunk-tokens as the log-prob stage takes it: a number of tokens, or "auto"."""
        return self.logps_chunk_tokens if self.logps_chunk_tokens == "auto" else int(self.logps_chunk_tokens)

    def data_config(self) -> DataConfig:
        """The data stage's settings (the embedded synthetic dataset is labelled 'synthetic')."""
        return DataConfig.from_settings(self, dataset=self.dataset or "synthetic")

    def plan_config(self, layout) -> PlanConfig:
        """The plan of this run laid out as ``layout`` (a run.layout.ParallelLayout).

        The plan deals every step over the data-parallel shares; under sequence
        parallelism a row is shared by the ``sp_size`` ranks of a group, so it holds
        ``sp_size`` x the per-rank budget.
        """
        return PlanConfig(max_tokens_per_row=self.row_budget * layout.sp_size, dp_size=layout.dp_size,
                          seed=self.seed, global_batch_pairs=self.batch_pairs, tokens_per_step=self.tokens_per_step,
                          drop_last=self.drop_last, attention_weight=self.attention_weight, packing=self.packing,
                          micro_batch_pairs=self.micro_batch_pairs, prefix_sharing=self.shares_prefixes,
                          prompt_groups=self.shares_prefixes and self.prompt_groups)

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

    @property
    def monitors(self) -> list[str]:
        """--report-to as a list (in the order given, each once)."""
        names = [name.strip() for name in (self.report_to or "").split(",") if name.strip()]
        return list(dict.fromkeys(names))

    @property
    def resolved_run_name(self) -> str:
        return self.run_name or Path(self.output_dir).resolve().name

    @property
    def resolved_metrics_out(self) -> str:
        return self.metrics_out or os.path.join(self.output_dir, "metrics.jsonl")

    def local_inputs(self) -> list[str]:
        """The files and folders on this machine that the run reads: an output written over one would lose it."""
        paths = (self.dataset, self.eval_dataset, self.model, self.model_config, self.ref_model, self.ref_logps,
                 self.tokenizer, self.config, self.ds_config)
        return [path for path in paths if path and Path(path).expanduser().exists()]

    def is_given(self, name: str) -> bool:
        """Whether the user wrote setting ``name`` (a field name) rather than leaving it at its default."""
        return name in self.given

    def validate(self, unused: frozenset[str] = frozenset()) -> None:
        """Checks that need nothing but the settings themselves (``unused``: those the command sets aside)."""
        for f in flag_fields(type(self)):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise InputError(f"--{flag(f.name)}: {getattr(self, f.name)!r} is not one of {', '.join(choices)}")
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise InputError(f"--{flag(f.name)} must be a finite number, got {value}")
            if isinstance(value, int) and not isinstance(value, bool) and value > LARGEST_COUNT and f.name != "seed":
                raise InputError(f"--{flag(f.name)} must be at most {LARGEST_COUNT}, got {value}")
        if not 0 <= self.seed <= LARGEST_SEED:
            raise InputError(f"--seed must be in [0, {LARGEST_SEED}] (numpy's seeds), got {self.seed}")
        self.loss_config(together=False)
        for key in ("weight_decay", "max_grad_norm", "warmup_steps", "adam_epsilon", "attention_weight"):
            if getattr(self, key) < 0:
                raise InputError(f"--{flag(key)} must be >= 0, got {getattr(self, key)}")
        positive = ["max_length", "synthetic_pairs", "micro_batch_pairs", "epochs", "num_proc", "sequence_parallel_size",
                    "logging_steps"]
        for key in positive:
            if getattr(self, key) < 1:
                raise InputError(f"--{flag(key)} must be >= 1, got {getattr(self, key)}")
        if self.logps_chunk_tokens != "auto" and not (self.logps_chunk_tokens.isdigit() and int(self.logps_chunk_tokens)):
            raise InputError(f"--logps-chunk-tokens must be 'auto' or a number >= 1, got {self.logps_chunk_tokens!r}")
        for key in ["max_tokens_per_row", "global_batch_pairs", "tokens_per_step", "max_steps", "max_prompt_length", "max_pairs",
                    "eval_steps", "eval_max_pairs"]:
            value = getattr(self, key)
            if value is not None and value < 1:
                raise InputError(f"--{flag(key)} must be >= 1, got {value}")
        if self.global_batch_pairs is not None and self.tokens_per_step is not None:
            raise InputError("--global-batch-pairs and --tokens-per-step are exclusive; give one")
        if self.max_prompt_length is not None and self.max_prompt_length >= self.max_length:
            raise InputError(f"--max-prompt-length ({self.max_prompt_length}) must be below --max-length ({self.max_length})")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise InputError(f"--{flag(key)} must be in [0, 1), got {getattr(self, key)}")
        if self.lr <= 0:  # (--beta > 0 is the loss settings' rule, checked above)
            raise InputError(f"--lr and --beta must be > 0, got lr={self.lr} beta={self.beta}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise InputError(f"--peak-tflops must be > 0, got {self.peak_tflops}")
        if not 0 < self.stop_grace_s < math.inf:
            raise InputError(f"--stop-grace-s must be > 0 seconds, got {self.stop_grace_s}")
        if self.collective_timeout_s <= 0:
            raise InputError(f"--collective-timeout-s must be > 0, got {self.collective_timeout_s}")
        for key in ("output_dir", "save_dir", "cache_dir"):  # folders the ranks make: the OS must let them
            if getattr(self, key) and key not in unused:  # eval's default runs/train is never made
                check_creatable_folder(getattr(self, key), f"--{flag(key)}")
        if self.metrics_out:
            check_not_an_input(self.metrics_out, "--metrics-out", self.local_inputs())
            check_creatable_folder(Path(self.metrics_out).parent, "--metrics-out")
        if self.model is not None and self.model_config is not None:
            raise InputError("--model and --model-config are exclusive: load a folder or build from a config")
        for key in ("model", "ref_model"):
            if getattr(self, key) is not None:
                check_model_source(getattr(self, key), f"--{flag(key)}")
        if self.tokenizer is not None and not Path(self.tokenizer).is_dir():
            if not is_hub_id(self.tokenizer):
                raise InputError(f"--tokenizer {self.tokenizer}: no such folder, and not a hub id")
            check_bare_name(self.tokenizer, "--tokenizer", "tokenizer_config.json")
        if self.revision is not None and (self.model is None or not is_hub_id(self.model)):
            raise InputError(f"--revision {self.revision}: names a revision of a hub --model, and --model "
                             f"{self.model or '(none)'} is not a hub id")
        for key in ("save_steps", "save_total_limit"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise InputError(f"--{flag(key)} must be >= 1, got {value}")
        self._validate_scale_settings()
        unknown = sorted(set(self.monitors) - set(MONITORS))
        if unknown:
            raise InputError(f"--report-to: {', '.join(unknown)} is not one of {', '.join(MONITORS)}")
        if self.max_bad_steps < 1:
            raise InputError(f"--max-bad-steps must be >= 1, got {self.max_bad_steps}")
        if self.save_total_limit is not None and not self.save_steps:
            raise InputError("--save-total-limit needs --save-steps (nothing is saved without it)")
        if self.allow_new_layout and self.resume is None:
            raise InputError("--allow-new-layout needs --resume (it says how to load a checkpoint)")
        if self.resume is not None and self.resume != "auto" and not Path(self.resume).exists():
            raise InputError(f"--resume {self.resume}: no such checkpoint folder (or pass 'auto')")
        if self.model is None and self.ref_model is not None:
            raise InputError("--ref-model needs --model (a model built from a config is its own reference)")
        self._validate_lora()
        self._validate_ref_sync()
        if self.ref_logps is not None:
            if not Path(self.ref_logps).is_file():
                raise InputError(f"--ref-logps {self.ref_logps}: no such file")
            if self.ref_logps_conflict():
                raise InputError(f"--ref-logps {self.ref_logps}: {self.ref_logps_conflict()}; drop one of them")

    def ref_logps_conflict(self) -> str | None:
        """Why these settings take no precomputed reference (None: they do)."""
        if not self.loss_config(together=False).needs_reference:
            return f"--loss {self.loss} is reference-free"
        return "--ref-offload needs a reference model" if self.ref_offload else None

    def _validate_scale_settings(self) -> None:
        """The LR schedule and the held-out evaluation settings."""
        if self.warmup_ratio is not None:
            if not 0.0 <= self.warmup_ratio < 1.0:
                raise InputError(f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
            if self.warmup_steps:
                raise InputError("--warmup-steps and --warmup-ratio are exclusive; give one")
        if not 0.0 <= self.min_lr_ratio < 1.0:
            raise InputError(f"--min-lr-ratio must be in [0, 1), got {self.min_lr_ratio}")
        if self.lr_scheduler == "constant" and self.min_lr_ratio:
            raise InputError(f"--min-lr-ratio {self.min_lr_ratio} has no effect with --lr-scheduler constant (it is the "
                             f"floor of linear and cosine); set it to 0 or pick one of them")
        if self.eval_fraction is not None:
            if not 0.0 < self.eval_fraction < 1.0:
                raise InputError(f"--eval-fraction must be in (0, 1), got {self.eval_fraction}")
            if self.eval_dataset is not None:
                raise InputError("--eval-dataset and --eval-fraction are exclusive: evaluate on another dataset or on "
                                 "a held-out part of --dataset")
        if self.eval_dataset is None and self.eval_fraction is None:
            for key in ("eval_steps", "eval_max_pairs"):
                if getattr(self, key) is not None:
                    raise InputError(f"--{flag(key)} needs a held-out set: --eval-dataset or --eval-fraction")
        if self.eval_dataset is not None and self.ref_logps is not None:
            raise InputError(f"--eval-dataset with --ref-logps {self.ref_logps}: the file holds the reference log-probs "
                             f"of --dataset only; evaluate on --eval-fraction of it, or drop --ref-logps")


    def _validate_ref_sync(self) -> None:
        """TR-DPO needs a reference model of its own to mix (TRL refuses PEFT and precomputed log-probs alike)."""
        if not self.sync_ref_model:
            defaults = (("ref_model_mixup_alpha", 0.6), ("ref_model_sync_steps", 512))
            written = [f"--{flag(key)}" for key, default in defaults if getattr(self, key) != default]
            if written:
                raise InputError(f"{', '.join(written)} without --sync-ref-model has no effect (add --sync-ref-model)")
            return
        if not 0.0 <= self.ref_model_mixup_alpha <= 1.0:
            raise InputError(f"--ref-model-mixup-alpha must be in [0, 1], got {self.ref_model_mixup_alpha}")
        if self.ref_model_sync_steps < 1:
            raise InputError(f"--ref-model-sync-steps must be >= 1, got {self.ref_model_sync_steps}")
        if self.lora_r:
            raise InputError("--sync-ref-model with --lora-r: LoRA's reference is the policy with its adapters off "
                             "(or a --ref-model the adapters never reach), not a model to mix toward the policy; TRL "
                             "refuses it too; train every weight to use TR-DPO")
        if self.ref_logps is not None:
            raise InputError(f"--sync-ref-model with --ref-logps {self.ref_logps}: precomputed log-probs are of a fixed "
                             f"reference, which TR-DPO moves; drop one of them")
        loss = self.loss_config(together=False)
        if not loss.needs_reference:
            raise InputError(f"--sync-ref-model with --loss {self.loss}: {loss.specs[0].title} is reference-free, "
                             f"there is no reference to mix")

    def _validate_lora(self) -> None:
        if self.lora_r < 0:
            raise InputError(f"--lora-r must be >= 0 (0: full fine-tuning), got {self.lora_r}")
        if not self.lora_r:
            given = [f"--{flag(key)}" for key, default in (("lora_alpha", None), ("lora_dropout", 0.0),
                                                          ("lora_target_modules", "all-linear"))
                     if getattr(self, key) != default]
            if given:
                raise InputError(f"{', '.join(given)} without --lora-r: LoRA is off (give --lora-r R > 0)")
            return
        if self.lora_alpha is not None and self.lora_alpha <= 0:
            raise InputError(f"--lora-alpha must be > 0, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise InputError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if not [name for name in self.lora_target_modules.split(",") if name.strip()]:
            raise InputError("--lora-target-modules: no module name given")
        if self.ref_offload and self.ref_model is None and self.ref_logps is None:
            raise InputError("--ref-offload with --lora-r: the reference is the policy with its adapters off, there "
                             "is no reference model to offload (give --ref-model to use a separate one)")

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
        if name not in fields or name == "config":
            hint = "; a settings file cannot name another" if name == "config" else ""
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
