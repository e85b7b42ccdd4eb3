"""Which training settings each command that takes the training flags does not act on.

eval, precompute-ref and bench take every train flag (so one recipe or command line serves them all), but a
command honours a setting it accepts or refuses it.  Typed on its command line, a setting it would run without is
refused in one line before any rank starts; from a --config recipe (written for training) it is set back to its
default with one ``warning:`` line, so the recipe still runs: each command's parse hands its entry of
:data:`NOT_ACTED_ON` to :func:`ds_packdpo.config.config_from_args` (``aside``), which sets them aside before
validating the rest.
"""

from __future__ import annotations

from .config import flag

# The held-out evaluation of a training run (of --eval-fraction or --eval-dataset, every --eval-steps).
HELD_OUT_SETTINGS = ("eval_dataset", "eval_fraction", "eval_steps", "eval_max_pairs")
# What a training run writes besides its steps: checkpoints, resume, export, the metrics file, the monitors and the
# step profile.
RUN_OUTPUT_SETTINGS = ("save_steps", "save_dir", "save_total_limit", "resume", "allow_new_layout", "export_on_end",
                       "max_shard_size", "metrics_out", "report_to", "run_name", "project", "profile_steps")
# How a run trains: the optimizer and its LR schedule, how many steps, a bad step, the step log and its MFU,
# TR-DPO's mixing, LoRA's adapters, activation checkpointing (a backward's).
TRAINING_SETTINGS = ("optimizer", "lr", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "warmup_steps",
                     "warmup_ratio", "lr_scheduler", "min_lr_ratio", "max_grad_norm", "epochs", "max_steps",
                     "drop_last", "max_bad_steps", "logging_steps", "peak_tflops", "sync_ref_model",
                     "ref_model_mixup_alpha", "ref_model_sync_steps", "lora_r", "lora_alpha", "lora_dropout",
                     "lora_target_modules", "gradient_checkpointing")
# The loss of the policy's log-probs (WPO's weighting is the policy's too); --ld-alpha weighs the reference's sums
# as well, so precompute-ref keeps it.
LOSS_SETTINGS = ("loss", "loss_weights", "beta", "label_smoothing", "simpo_gamma", "rpo_alpha", "f_divergence_type",
                 "f_alpha_divergence_coef", "discopop_tau", "use_weighting")

# command -> ((settings it does not act on, why), ...), set aside in this order (one warning each)
NOT_ACTED_ON: dict[str, tuple[tuple[tuple[str, ...], str], ...]] = {
    "bench": (
        (HELD_OUT_SETTINGS, "bench measures training steps only (evaluate a model with 'ds-packdpo eval')"),
        (RUN_OUTPUT_SETTINGS, "bench measures training steps and writes only its report (no checkpoint, resume, "
                              "export, metrics file, monitor or profile)"),
    ),
    # eval plans every held-out pair as one step (no batch of steps) and prints its figures (no folder).
    "eval": (
        ((*TRAINING_SETTINGS, *RUN_OUTPUT_SETTINGS, "eval_steps", "global_batch_pairs", "tokens_per_step",
          "output_dir", "overwrite"),
         "eval runs forward only over every held-out pair in one step and prints its figures (no optimizer, "
         "schedule, training steps, LoRA, TR-DPO, output folder, checkpoint or monitor)"),
    ),
    # precompute-ref runs the reference alone, over every pair once, and writes --out (in --out's folder).
    "precompute-ref": (
        ((*TRAINING_SETTINGS, *RUN_OUTPUT_SETTINGS, *HELD_OUT_SETTINGS, *LOSS_SETTINGS, "ref_logps", "output_dir"),
         "precompute-ref runs the reference model alone over every pair once and writes only --out (no policy, "
         "loss, training, held-out evaluation, --ref-logps or output folder)"),
    ),
}


def not_acted_on(command: str) -> tuple[str, ...]:
    """Every setting ``command`` sets aside (field names)."""
    return tuple(name for names, _ in NOT_ACTED_ON[command] for name in names)


def refused_epilog(command: str) -> str:
    """The --help line that names what ``command`` refuses."""
    names = ", ".join(f"--{flag(name)}" for name in not_acted_on(command))
    return (f"Refuses the training flags it does not act on ({names}): typed, in one line before any rank starts; "
            f"from a --config recipe, set aside with one warning.")
