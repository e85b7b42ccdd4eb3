"""One rule for the values a DeepSpeed config and the flags can both give.

The optimizer (type, lr, betas, eps, weight decay), the gradient clipping, the LR
scheduler and its parameters, the precision, the batch keys, the monitors and ZeRO's communication
(prefetch and reduce buckets, persistence threshold, overlap_comm) can be written in
``--ds-config`` or as flags (on the command line or in ``--config``).  The rule, as in
the HF Trainer's DeepSpeed integration, where users learnt it:

* a value written in one place only runs, whichever place that is;
* a value written in both places must be the same, else one error naming both;
* a default never overrides, nor contradicts, a value the user wrote.

:func:`take_user_values` applies it in phase one: a value the DeepSpeed config writes
becomes the run's setting (so the plan line, plan_summary.json, run_config.json and
the metrics report what runs), and its place in the config becomes "auto", which
:func:`engines.fill_ds_config` then fills from those settings.  Flags left at their
defaults are told apart from written ones by the settings the user wrote (``given``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping

from ..config import flag
from ..errors import InputError
from .metrics import MONITORS
from .schedule import DEEPSPEED_SCHEDULERS

SCHEDULE_KINDS = {name: kind for kind, name in DEEPSPEED_SCHEDULERS.items()}  # WarmupLR -> constant, ...
_ADAM_FAMILY = ("adam", "adamw")  # the optimizers whose params take betas and eps


class _Taken:
    """The values read from one DeepSpeed config, each with the key it came from, against the flags' ``settings``
    (name -> value) of which the user wrote ``given``."""

    def __init__(self, settings: Mapping[str, object], given: frozenset[str], source: str):
        self.settings = settings
        self.given = set(given)
        self.source = source
        self.values: dict[str, object] = {}  # setting -> value
        self.keys: dict[str, str] = {}  # setting -> the DeepSpeed config key that wrote it

    def is_given(self, setting: str) -> bool:
        return setting in self.given

    def take(self, setting: str, value, key: str, shown: str | None = None) -> None:
        """``key`` of the DeepSpeed config writes ``setting`` = ``value`` (``shown``: what the file says, when not
        ``value`` itself)."""
        shown = repr(value) if shown is None else shown
        where = f"--ds-config {self.source}: '{key}': {shown}"
        if setting in self.values and not _same(self.values[setting], value):
            raise InputError(f"{where} and '{self.keys[setting]}' differ ({flag(setting)}); give it once")
        current = self.settings[setting]
        if self.is_given(setting) and not _same(current, value):
            raise InputError(f"{where} and --{flag(setting)} {current} differ; give it in one place")
        self.values[setting] = value
        self.keys[setting] = key


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    return a == b


def _written(node: dict, key: str) -> bool:
    return key in node and node[key] != "auto"


def _number(value, key: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"--ds-config {source}: '{key}' must be a finite number, got {value!r}")
    return value


def _section(raw: dict, key: str, source: str) -> dict:
    node = raw.get(key, {})
    if node == "auto":
        return {}
    if not isinstance(node, dict):
        raise InputError(f"--ds-config {source}: '{key}' must be a mapping, got {node!r}")
    return node


def _take_optimizer(raw: dict, taken: _Taken) -> None:
    """The optimizer section and the gradient clipping."""
    if _written(raw, "gradient_clipping"):
        taken.take("max_grad_norm", _number(raw["gradient_clipping"], "gradient_clipping", taken.source),
                   "gradient_clipping")
        raw["gradient_clipping"] = "auto"
    optimizer = _section(raw, "optimizer", taken.source)
    if _written(optimizer, "type"):
        if not isinstance(optimizer["type"], str):
            raise InputError(f"--ds-config {taken.source}: 'optimizer.type' must be a name, got {optimizer['type']!r}")
        taken.take("optimizer", optimizer["type"], "optimizer.type")
        optimizer["type"] = "auto"
    params = _section(optimizer, "params", taken.source)
    for key, setting in (("lr", "lr"), ("eps", "adam_epsilon"), ("weight_decay", "weight_decay")):
        if _written(params, key):
            taken.take(setting, _number(params[key], f"optimizer.params.{key}", taken.source),
                       f"optimizer.params.{key}")
            params[key] = "auto"
    if _written(params, "betas"):
        betas = params["betas"]
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
            raise InputError(f"--ds-config {taken.source}: 'optimizer.params.betas' must be two numbers, got {betas!r}")
        for setting, beta in zip(("adam_beta1", "adam_beta2"), betas):
            taken.take(setting, _number(beta, "optimizer.params.betas", taken.source), "optimizer.params.betas",
                       repr(betas))
        params["betas"] = "auto"


def _take_scheduler(raw: dict, taken: _Taken) -> None:
    """A WarmupLR / WarmupDecayLR / WarmupCosineLR section is --lr-scheduler constant / linear / cosine with its
    parameters as the flags; what it leaves out comes from the flags.  What no flag can say is refused."""
    source = taken.source
    scheduler = raw.get("scheduler")
    if scheduler is None or scheduler == "auto":
        return
    if not isinstance(scheduler, dict):
        raise InputError(f"--ds-config {source}: 'scheduler' must be a mapping or \"auto\", got {scheduler!r}")
    kind = scheduler.get("type", "auto")
    if kind != "auto":
        if kind not in SCHEDULE_KINDS:
            raise InputError(f"--ds-config {source}: 'scheduler.type': {kind!r} is not one ds_packdpo runs "
                             f"({', '.join(f'{n} (--lr-scheduler {k})' for n, k in SCHEDULE_KINDS.items())})")
        taken.take("lr_scheduler", SCHEDULE_KINDS[kind], "scheduler.type", repr(kind))
    params = scheduler.get("params", "auto")
    if params == "auto":
        params = {}
    if not isinstance(params, dict):
        raise InputError(f"--ds-config {source}: 'scheduler.params' must be a mapping or \"auto\", got {params!r}")
    params = {key: value for key, value in params.items() if value != "auto"}
    if "total_num_steps" in params:
        raise InputError(f"--ds-config {source}: 'scheduler.params.total_num_steps': {params['total_num_steps']!r}: "
                         f"the run's steps come from the plan (--epochs, --max-steps); remove it or set it to \"auto\"")
    if params.get("warmup_type", "linear") != "linear":
        raise InputError(f"--ds-config {source}: 'scheduler.params.warmup_type': {params['warmup_type']!r}: the "
                         f"warm-up is linear (--warmup-steps); remove it or set it to \"linear\"")
    params.pop("warmup_type", None)
    if "warmup_num_steps" in params:
        steps = params.pop("warmup_num_steps")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise InputError(f"--ds-config {source}: 'scheduler.params.warmup_num_steps' must be an integer >= 0, "
                             f"got {steps!r}")
        if taken.is_given("warmup_ratio"):
            raise InputError(f"--ds-config {source}: 'scheduler.params.warmup_num_steps': {steps} and --warmup-ratio "
                             f"{taken.settings['warmup_ratio']} both set the warm-up; give it in one place")
        taken.take("warmup_steps", steps, "scheduler.params.warmup_num_steps")
    if "warmup_max_lr" in params:
        taken.take("lr", _number(params.pop("warmup_max_lr"), "scheduler.params.warmup_max_lr", source),
                   "scheduler.params.warmup_max_lr")
    ratios = {key: _number(params.pop(key), f"scheduler.params.{key}", source)
              for key in ("warmup_min_ratio", "cos_min_ratio") if key in params}
    for key, ratio in ratios.items():
        taken.take("min_lr_ratio", ratio, f"scheduler.params.{key}")
    if "warmup_min_lr" in params:
        floor = _number(params.pop("warmup_min_lr"), "scheduler.params.warmup_min_lr", source)
        peak = taken.values.get("lr", taken.settings["lr"])
        if peak <= 0:
            raise InputError(f"--ds-config {source}: 'scheduler.params.warmup_min_lr' is a fraction of the peak LR, "
                             f"which must be > 0, got {peak}")
        taken.take("min_lr_ratio", floor / peak, "scheduler.params.warmup_min_lr",
                   f"{floor!r} (ratio {floor / peak:g})")
    if params:
        raise InputError(f"--ds-config {source}: 'scheduler.params.{next(iter(params))}' has no counterpart among the "
                         f"flags (--lr, --warmup-steps, --min-lr-ratio); remove it")
    raw["scheduler"] = "auto"


def _take_precision(raw: dict, taken: _Taken) -> None:
    if _section(raw, "fp16", taken.source).get("enabled") is True:
        raise InputError(f"--ds-config {taken.source}: fp16 is not supported (use --dtype bf16 or fp32)")
    bf16 = _section(raw, "bf16", taken.source)
    if _written(bf16, "enabled"):
        enabled = bf16["enabled"]
        if not isinstance(enabled, bool):
            raise InputError(f"--ds-config {taken.source}: 'bf16.enabled' must be true, false or \"auto\", got "
                             f"{enabled!r}")
        if taken.settings["dtype"] == "auto":  # a written --dtype auto leaves the choice open
            taken.given.discard("dtype")
        taken.take("dtype", "bf16" if enabled else "fp32", "bf16.enabled", repr(enabled))
        bf16["enabled"] = "auto"


def _take_batch(raw: dict, taken: _Taken, dp_size: int) -> None:
    """DeepSpeed's batch keys count pairs, as the HF Trainer's do: train_batch_size is --global-batch-pairs,
    train_micro_batch_size_per_gpu --micro-batch-pairs, and gradient_accumulation_steps says the global batch with
    them (micro x accumulation x data-parallel ranks).  The engine itself runs one planned row per forward."""
    source = taken.source
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    written = {}
    for key in keys:
        if _written(raw, key):
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"--ds-config {source}: '{key}' must be an integer >= 1 or \"auto\", got {value!r}")
            written[key] = value
            raw[key] = "auto"
    if "train_micro_batch_size_per_gpu" in written:
        taken.take("micro_batch_pairs", written["train_micro_batch_size_per_gpu"], "train_micro_batch_size_per_gpu")
    accumulation = written.get("gradient_accumulation_steps")
    total = written.get("train_batch_size")
    key, shown = "train_batch_size", None
    if accumulation is not None:
        micro = taken.values.get("micro_batch_pairs", taken.settings["micro_batch_pairs"])
        if total is None:
            total, key = micro * accumulation * dp_size, "gradient_accumulation_steps"
            shown = f"{accumulation} (x micro-batch {micro} x {dp_size} data-parallel ranks = {total} pairs)"
        elif "micro_batch_pairs" in taken.values or taken.is_given("micro_batch_pairs"):
            if total != micro * accumulation * dp_size:
                raise InputError(f"--ds-config {source}: 'train_batch_size': {total} is not micro-batch {micro} x "
                                 f"'gradient_accumulation_steps' {accumulation} x {dp_size} data-parallel ranks")
        elif total % (accumulation * dp_size):
            raise InputError(f"--ds-config {source}: 'train_batch_size': {total} is not a multiple of "
                             f"'gradient_accumulation_steps' {accumulation} x {dp_size} data-parallel ranks")
        else:
            taken.take("micro_batch_pairs", total // (accumulation * dp_size), "train_batch_size")
    if total is not None:
        if taken.is_given("tokens_per_step"):
            raise InputError(f"--ds-config {source}: '{key}' sets {total} pairs per step and --tokens-per-step "
                             f"{taken.settings['tokens_per_step']} closes steps by tokens; give one")
        taken.take("global_batch_pairs", total, key, shown)


def _take_monitors(raw: dict, taken: _Taken) -> None:
    """The monitor sections a config enables or disables are --report-to's list: the same set when both say it."""
    written = {name: raw[key]["enabled"] for name, key in MONITORS.items()
               if isinstance(raw.get(key), dict) and isinstance(raw[key].get("enabled"), bool)}
    if not written:
        return
    enabled = [name for name, on in written.items() if on]
    if taken.is_given("report_to"):
        asked = set(monitor_names(taken.settings["report_to"]))
        clash = sorted(name for name, on in written.items() if on != (name in asked))
        if clash:
            key = MONITORS[clash[0]]
            raise InputError(f"--ds-config {taken.source}: '{key}.enabled': {written[clash[0]]!r} and --report-to "
                             f"{taken.settings['report_to']} differ; give it in one place")
        return
    taken.take("report_to", ",".join(enabled), "monitor sections' enabled")


# zero_optimization's communication keys and the settings that give them (run/engines.ZeroSpec)
ZERO_KEYS = {"stage3_prefetch_bucket_size": "zero_prefetch_bucket_size",
             "stage3_param_persistence_threshold": "zero_param_persistence_threshold",
             "reduce_bucket_size": "zero_reduce_bucket_size", "overlap_comm": "zero_overlap_comm"}


def _take_zero(raw: dict, taken: _Taken) -> None:
    """The ZeRO communication keys the config writes are the --zero-* settings (sizes count elements, as there)."""
    zero = _section(raw, "zero_optimization", taken.source)
    for key, setting in ZERO_KEYS.items():
        if not _written(zero, key):
            continue
        value, where = zero[key], f"zero_optimization.{key}"
        if setting == "zero_overlap_comm":
            if not isinstance(value, bool):
                raise InputError(f"--ds-config {taken.source}: '{where}' must be true, false or \"auto\", got "
                                 f"{value!r}")
        else:
            value = _number(value, where, taken.source)
            if value < 0 or value != int(value):
                raise InputError(f"--ds-config {taken.source}: '{where}' must be a whole number >= 0, got {value!r}")
            value = int(value)
        taken.take(setting, value, where, repr(zero[key]))
        zero[key] = "auto"


def monitor_names(report_to: str | None) -> tuple[str, ...]:
    """--report-to as a list (in the order given, each once)."""
    return tuple(dict.fromkeys(name.strip() for name in (report_to or "").split(",") if name.strip()))


def take_user_values(settings: Mapping[str, object], given: frozenset[str], raw: dict, source: str,
                     dp_size: int) -> tuple[dict[str, object], dict[str, str], dict]:
    """(the values the DeepSpeed config writes, by setting; the key each came from; the config with "auto" in their
    places), after the rule of the module docstring, against the flags' ``settings`` of which the user wrote
    ``given``.  The values taken count as written."""
    raw = copy.deepcopy(raw)
    taken = _Taken(settings, given, source)
    _take_optimizer(raw, taken)
    _take_scheduler(raw, taken)
    _take_precision(raw, taken)
    _take_batch(raw, taken, dp_size)
    _take_monitors(raw, taken)
    _take_zero(raw, taken)
    return taken.values, taken.keys, raw


def monitor_sections(outputs, ds: dict) -> None:
    """The monitor sections of --report-to (``outputs``, a metrics.OutputSpec) in ``ds`` (a config's own settings in
    them kept): enabled, under the output folder, named after the run, in --project."""
    for name in outputs.monitors:
        section = ds.setdefault(MONITORS[name], {})
        section["enabled"] = True
        if name in ("tensorboard", "csv"):
            section.setdefault("output_path", str(outputs.output_dir))
            section.setdefault("job_name", outputs.run_name)
        elif name == "wandb":
            section.setdefault("group", outputs.run_name)
        else:
            section.setdefault("experiment_name", outputs.run_name)
        if name in ("wandb", "comet") and outputs.project is not None:
            section.setdefault("project", outputs.project)


def optimizer_section(name: str) -> dict:
    """The optimizer DeepSpeed builds when the config has none: the run's settings (betas and eps for Adam/AdamW)."""
    params = {"lr": "auto", "weight_decay": "auto"}
    if name.lower() in _ADAM_FAMILY:
        params.update(betas="auto", eps="auto")
    return {"type": "auto", "params": params}


def check_adam_settings(optimizer: str, given: frozenset[str]) -> None:
    """--adam-beta1/2 and --adam-epsilon (among the settings written, ``given``) configure Adam and AdamW only."""
    if optimizer.lower() in _ADAM_FAMILY:
        return
    written = [f"--{flag(key)}" for key in ("adam_beta1", "adam_beta2", "adam_epsilon") if key in given]
    if written:
        raise InputError(f"{', '.join(written)} with --optimizer {optimizer}: they configure Adam and AdamW "
                         f"only; drop them")
