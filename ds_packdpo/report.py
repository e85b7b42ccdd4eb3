"""The bench report: ``report.json`` (schema below), ``report.md`` and PNG plots; and the merge of several.

A bench folder holds::

    report.json        the figures (REPORT_SCHEMA / RUN_SCHEMA: every key, always present)
    report.md          the tables a person reads
    tokens_per_s.png   real (and computed) tokens/s per configuration
    rank_load.png      tokens per rank per measured step, one panel per configuration
    lengths.png        the sequence-length histogram and the fill of the packed rows

``ds-packdpo report DIR [DIR ...] --out OUT`` reads the ``report.json`` of every folder
and writes one comparison (``merged.json``, ``report.md``, ``tokens_per_s.png``), for
example across node counts or clusters.  Folders are written into a temporary
sibling and renamed into place, so a reader never sees a half-written report.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from .errors import InputError
from .files import atomic_folder, check_output_folder
from .model.loss_registry import needs_policy_prepass

matplotlib.use("Agg")  # files only, no display

SCHEMA_VERSION = 7  # 2: the parallel layout, per-step loss and grad norm, the trajectory check; 3: prefix sharing;
# 4: prepass_flops (the aot pre-pass, outside the model FLOPs) and the loss in a merged report; 5: prompt groups'
# speedup; 6: the configurations a bench that ended early did not measure; 7: a run's lock-step utilization and the
# prompt tokens it copied to spread prompt groups over ranks (null in older reports)
OLDEST_READ_VERSION = 3  # schema 3 lacks prepass_flops (upgrade_schema_3), 3 and 4 the prompt-group figures, which
# their runs give (prompt_groups_figures), and 3 to 5 wrote a report only once every configuration was measured:
# clusters benched before still merge
NUMBER = (int, float)
UNSHARED = "packed-no-prefix-sharing"  # packing alone: the baseline of prefix sharing
GROUPS_OFF = "packed-no-prompt-groups"  # prefix sharing pair by pair: the baseline of prompt groups
OPTIONAL_NUMBER = (int, float, type(None))

# key -> (type(s), meaning).  Documented in the README; tests check every key and its type.
REPORT_SCHEMA = {
    "schema_version": (int, "version of this schema"),
    "created_utc": (str, "ISO time the report was written"),
    "command": (str, "the command line of rank 0"),
    "world_size": (int, "every rank of the job"),
    "dp_size": (int, "data-parallel ranks (world_size / sp_size)"),
    "sp_size": (int, "ranks that share one row (--sequence-parallel-size)"),
    "dataset": (str, "dataset path or name ('synthetic' for the embedded one)"),
    "model": (dict, "source, architecture, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, vocab_size"),
    "environment": (dict, "python, torch, deepspeed, transformers, device_type, device_name, hostname, torch_threads"),
    "settings": (dict, "every train setting, plus bench_warmup_steps, configurations, row_budget"),
    "runs": (dict, "configuration name -> figures (RUN_SCHEMA); 'packed' and 'padded' by default"),
    "unmeasured": (list, "configurations asked for and not measured: the report is rewritten after each one, so a "
                         "bench that ended early (out of memory, a crash) keeps what it measured; the first was the "
                         "one running when it ended (empty: the bench finished)"),
    "speedup": (OPTIONAL_NUMBER, "runs.packed.tokens_per_s / runs.padded.tokens_per_s (null without both)"),
    "ideal_speedup": (OPTIONAL_NUMBER, "runs.padded.computed_tokens / runs.packed.computed_tokens: the speedup if time "
                                       "were proportional to computed tokens (null without both)"),
    "speedup_over_ideal": (OPTIONAL_NUMBER, "speedup / ideal_speedup"),
    "prefix_sharing_speedup": (OPTIONAL_NUMBER, "runs.packed.pairs_per_s / runs['packed-no-prefix-sharing'].pairs_per_s:"
                                                " what computing each prompt once adds to packing (null without both)"),
    "prefix_sharing_ideal_speedup": (OPTIONAL_NUMBER, "runs['packed-no-prefix-sharing'].computed_tokens / "
                                                      "runs.packed.computed_tokens: tokens without sharing / tokens "
                                                      "with (null without both)"),
    "prompt_groups_speedup": (OPTIONAL_NUMBER, f"runs.packed.pairs_per_s / runs['{GROUPS_OFF}'].pairs_per_s: what "
                                               "computing each response of a prompt once adds to prefix sharing (null "
                                               "without both)"),
    "prompt_groups_ideal_speedup": (OPTIONAL_NUMBER, f"runs['{GROUPS_OFF}'].computed_tokens / "
                                                     "runs.packed.computed_tokens (null without both)"),
    "loss_max_rel_diff": (OPTIONAL_NUMBER, "largest |loss - first configuration's loss| / |first's| over the measured "
                                           "steps of the configurations that train the same parameters as the first "
                                           "(not the LoRA ones of a full fine-tuning first): they train the same pairs, "
                                           "so this is rounding (null when no other configuration compares)"),
    "same_trajectory": ((bool, type(None)), "loss_max_rel_diff is within SAME_TRAJECTORY_RTOL of --dtype (null when "
                                             "no other configuration compares)"),
}
# Packed, padded, dense-mask or precomputed-reference runs of the same steps differ only by rounding: measured
# here <= 1e-6 relative in fp32; bf16 rounds each log-prob to ~3 significant digits.
SAME_TRAJECTORY_RTOL = {"fp32": 1e-4, "bf16": 5e-2}
RUN_SCHEMA = {
    "name": (str, "configuration name"),
    "overrides": (dict, "train settings this configuration overrides"),
    "attn": (str, "attention backend used"),
    "packing": (bool, "packed rows (true) or padded micro-batches (false)"),
    "sequence_parallel_size": (int, "ranks that shared each row"),
    "measured_steps": (int, "optimizer steps measured (after the warm-up steps)"),
    "tokens_per_s": (NUMBER, "real (non-padding) tokens per second, all ranks"),
    "pairs_per_s": (NUMBER, "preference pairs per second, all ranks"),
    "computed_tokens_per_s": (NUMBER, "tokens run through the model per second, padding included"),
    "step_time_s": (dict, "median, p90, mean, min, max of the step wall time (slowest rank per step)"),
    "real_tokens": (int, "real tokens of the measured steps"),
    "computed_tokens": (int, "tokens the model ran in the measured steps, padding included, a shared prompt once"),
    "prompt_tokens_shared": (int, "prompt tokens not run a second time: each pair's prompt computed once for both "
                                  "completions (0 without prefix sharing); real_tokens - prompt_tokens_shared + "
                                  "padding = computed_tokens"),
    "pairs": (int, "pairs of the measured steps"),
    "utilization": (NUMBER, "(real_tokens - prompt_tokens_shared) / computed_tokens: the share of computed tokens "
                            "that are not padding"),
    "rank_load_max_over_mean": (NUMBER, "worst step's max/mean computed tokens per rank (1.0 = perfectly balanced)"),
    "rank_load_max_over_mean_mean": (NUMBER, "the same, averaged over the measured steps"),
    "rows_per_rank_mean": (NUMBER, "forward passes (rows or micro-batches) per rank per step"),
    "lockstep_utilization": (OPTIONAL_NUMBER, "the plan's computed tokens / (data-parallel ranks x sum over row slots "
                                              "of the slot's largest row): what ZeRO-3's lock-step pays for (null "
                                              "before schema 7)"),
    "prompt_copy_tokens": ((int, type(None)), "prompt tokens the rows computed beyond one copy per prompt group of a "
                                              "step: what spreading a group's responses over ranks spent on balance "
                                              "(0 without prompt groups; null before schema 7)"),
    "peak_mem_mb": (NUMBER, "highest peak over ranks, MiB"),
    "peak_mem_mb_per_rank": (list, "peak of each rank, MiB"),
    "peak_mem_kind": (str, "'rss' (CPU, sampled every 10 ms) or 'cuda_max_allocated'"),
    "model_flops": (NUMBER, "analytic model FLOPs of the measured steps (flops.py)"),
    "prepass_flops": (OPTIONAL_NUMBER, "analytic FLOPs of the no-grad policy pre-pass of --loss aot/aot_unpaired (one "
                                       "more policy forward per row) in the measured steps, 0 without it: its time is "
                                       "in the step times, but not in model_flops, model_tflops_per_s or mfu (null: a "
                                       "schema-3 report of such a loss, which did not record it)"),
    "model_tflops_per_s": (NUMBER, "model_flops / measured time / 1e12, all ranks"),
    "mfu": (OPTIONAL_NUMBER, "model_tflops_per_s / (peak_tflops x world_size); null without --peak-tflops"),
    "steps": (list, "per measured step: step, step_time_s, loss, grad_norm, pairs, real_tokens, computed_tokens, "
                    "prompt_tokens_shared, rows_per_rank, rank_tokens and rank_computed_tokens (per data-parallel "
                    "share; a shared prompt once), lockstep_tokens (sum over row slots of the largest row), "
                    "prompt_copy_tokens, attention_sq, flops, prepass_flops, row_fill, sequence_lengths"),
}
PLOTS = ("tokens_per_s.png", "rank_load.png", "lengths.png")


def _ratio(numerator, denominator):
    return numerator / denominator if numerator is not None and denominator else None


# Settings that change which parameters a configuration trains: such a configuration follows its own trajectory.
TRAINED_PARAMETER_SETTINGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")


def _trained_parameters(run: dict) -> dict:
    return {key: run["overrides"].get(key) for key in TRAINED_PARAMETER_SETTINGS}


def prompt_groups_figures(runs: dict) -> dict:
    """What prompt groups add over prefix sharing pair by pair: pairs/s measured and the computed tokens' ideal."""
    grouped, ungrouped = runs.get("packed"), runs.get(GROUPS_OFF)
    both = grouped is not None and ungrouped is not None
    return {"prompt_groups_speedup": _ratio(grouped["pairs_per_s"], ungrouped["pairs_per_s"]) if both else None,
            "prompt_groups_ideal_speedup": (_ratio(ungrouped["computed_tokens"], grouped["computed_tokens"])
                                            if both else None)}


def loss_max_rel_diff(runs: dict) -> float | None:
    """How far the per-step losses of the configurations that train the same parameters as the first are from the
    first configuration's (None when there is no such other configuration)."""
    first, *others = runs.values()
    compared = [run for run in others if _trained_parameters(run) == _trained_parameters(first)]
    if not compared:
        return None
    losses = {step["step"]: step["loss"] for step in first["steps"]}
    return max(abs(step["loss"] - losses[step["step"]]) / max(abs(losses[step["step"]]), 1e-12)
               for run in compared for step in run["steps"])


def build_report(command: str, layout: dict, dataset: str, model: dict, environment: dict, settings: dict,
                 runs: dict, unmeasured: tuple[str, ...] = ()) -> dict:
    """``layout``: the run's ParallelLayout.as_dict() (world_size, dp_size, sp_size); ``unmeasured``: the
    configurations still to measure when it is written."""
    packed, padded, unshared = runs.get("packed"), runs.get("padded"), runs.get(UNSHARED)
    speedup = _ratio(packed["tokens_per_s"], padded["tokens_per_s"]) if packed and padded else None
    ideal = _ratio(padded["computed_tokens"], packed["computed_tokens"]) if packed and padded else None
    sharing = _ratio(packed["pairs_per_s"], unshared["pairs_per_s"]) if packed and unshared else None
    sharing_ideal = _ratio(unshared["computed_tokens"], packed["computed_tokens"]) if packed and unshared else None
    diff = loss_max_rel_diff(runs)
    same = None if diff is None else diff <= SAME_TRAJECTORY_RTOL[settings["dtype"]]
    return {
        "schema_version": SCHEMA_VERSION,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command, **layout, "dataset": dataset, "model": model,
        "environment": environment, "settings": settings, "runs": runs, "unmeasured": list(unmeasured),
        "speedup": speedup, "ideal_speedup": ideal, "speedup_over_ideal": _ratio(speedup, ideal),
        "loss_max_rel_diff": diff, "same_trajectory": same,
        "prefix_sharing_speedup": sharing, "prefix_sharing_ideal_speedup": sharing_ideal,
        **prompt_groups_figures(runs),
    }


def check_report(report, source: str) -> dict:
    """Every documented key with its type, or InputError naming the file and the key."""
    if not isinstance(report, dict):
        raise InputError(f"{source}: expected a JSON object, got {type(report).__name__}")

    def check(node: dict, schema: dict, where: str) -> None:
        for key, (kind, _) in schema.items():
            if key not in node:
                raise InputError(f"{source}: missing key '{where}{key}'")
            value = node[key]
            if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
                raise InputError(f"{source}: key '{where}{key}' has type {type(value).__name__}")

    version = report.get("schema_version")  # first: an older report lacks keys, and its version says why
    if isinstance(version, int) and not OLDEST_READ_VERSION <= version <= SCHEMA_VERSION:
        raise InputError(f"{source}: schema_version {version} (this version reads {OLDEST_READ_VERSION} to "
                         f"{SCHEMA_VERSION}; rerun that bench with this version)")
    lacks_prompt_groups = isinstance(version, int) and version < 5
    if lacks_prompt_groups:  # the prompt-group figures, from its runs once they are checked
        report.update(dict.fromkeys(prompt_groups_figures({})))
    if isinstance(version, int) and version < 6:  # written complete or not at all
        report["unmeasured"] = []
    if isinstance(version, int) and version < 7:  # not recorded
        for run in report.get("runs", {}).values() if isinstance(report.get("runs"), dict) else ():
            if isinstance(run, dict):
                run.setdefault("lockstep_utilization", None)
                run.setdefault("prompt_copy_tokens", None)
    check(report, REPORT_SCHEMA, "")
    for name, run in report["runs"].items():
        if not isinstance(run, dict):
            raise InputError(f"{source}: runs.{name} is not an object")
    if report["schema_version"] == 3:
        upgrade_schema_3(report)
    for name, run in report["runs"].items():
        check(run, RUN_SCHEMA, f"runs.{name}.")
    if lacks_prompt_groups:
        report.update(prompt_groups_figures(report["runs"]))
    return report


def upgrade_schema_3(report: dict) -> None:
    """A schema-3 report in schema 4's form: its runs' ``prepass_flops`` is 0 for a loss without the aot pre-pass
    (nothing was left out) and null, unknown, for one with it (schema 3 did not record it)."""
    unrecorded = None if needs_policy_prepass(str(report["settings"].get("loss", "")).split(",")) else 0.0
    for run in report["runs"].values():
        run.setdefault("prepass_flops", unrecorded)


def _as_tuple(kind) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


def read_report(folder: str | Path) -> dict:
    path = Path(folder) / "report.json"
    if not path.is_file():
        raise InputError(f"report {folder}: no report.json in the folder")
    try:
        return check_report(json.loads(path.read_text()), str(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None


# ----------------------------------------------------------------------------- writing

def write_atomically(out: Path, overwrite: bool, fill) -> None:
    """Calls ``fill(tmp_folder)`` then renames the folder to ``out`` (replacing it only with ``overwrite``)."""
    check_output_folder(out, "--out", overwrite)  # checked before the work too; again now, when it is written
    atomic_folder(out, fill)


def write_report_folder(report: dict, out: Path, overwrite: bool = False) -> None:
    def fill(folder: Path) -> None:
        (folder / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        (folder / "report.md").write_text(render_markdown(report))
        plot_report(report, folder)

    write_atomically(out, overwrite, fill)


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


RUN_COLUMNS = [("configuration", lambda r: r["name"]), ("attn", lambda r: r["attn"]),
               ("tokens/s", lambda r: r["tokens_per_s"]), ("pairs/s", lambda r: r["pairs_per_s"]),
               ("step s (median)", lambda r: r["step_time_s"]["median"]), ("step s (p90)", lambda r: r["step_time_s"]["p90"]),
               ("real tokens", lambda r: r["real_tokens"]), ("computed tokens", lambda r: r["computed_tokens"]),
               ("utilization", lambda r: r["utilization"]), ("rank max/mean", lambda r: r["rank_load_max_over_mean"]),
               ("lock-step", lambda r: r["lockstep_utilization"]), ("prompt copies", lambda r: r["prompt_copy_tokens"]),
               ("fwd/rank/step", lambda r: r["rows_per_rank_mean"]), ("peak MiB", lambda r: r["peak_mem_mb"]),
               ("model TFLOP/s", lambda r: r["model_tflops_per_s"]), ("MFU", lambda r: r["mfu"])]


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def render_markdown(report: dict) -> str:
    env, model, settings = report["environment"], report["model"], report["settings"]
    runs = list(report["runs"].values())
    text = [
        f"# ds_packdpo throughput: {report['dataset']}\n",
        _unmeasured_line(report),
        f"{report['world_size']} ranks ({report['dp_size']} data-parallel x {report['sp_size']} sequence-parallel) on "
        f"{env['device_type']} ({env['device_name']}, host {env['hostname']}, "
        f"{env['torch_threads']} torch threads per rank); torch {env['torch']}, deepspeed {env['deepspeed']}, "
        f"transformers {env['transformers']}.\n",
        f"Model: {model['architecture']} from `{model['source']}`: hidden {model['hidden_size']}, {model['num_layers']} "
        f"layers, {model['num_heads']} heads ({model['num_kv_heads']} KV), vocab {model['vocab_size']}.\n",
        f"Settings: max length {settings['max_length']}, row budget {settings['row_budget']}, "
        f"{settings['global_batch_pairs']} pairs per step, padded micro-batch {settings['micro_batch_pairs']} pairs, "
        f"{settings['dtype']}, `{settings['ds_config']}`, {settings['bench_warmup_steps']} warm-up + "
        f"{settings['max_steps']} measured steps per configuration; loss {loss_text(settings)}.\n",
        _packing_line(report),
        _prefix_sharing_line(report),
        _prompt_groups_line(report),
        _table([c for c, _ in RUN_COLUMNS], [[get(r) for _, get in RUN_COLUMNS] for r in runs]),
        _flops_line(report),
        _trajectory_line(report),
        f"\nCommand: `{report['command']}`\n",
        "\n" + "".join(f"![{p}]({p})\n" for p in PLOTS),
    ]
    return "\n".join(text)


def _unmeasured_line(report: dict) -> str:
    """Said first: a bench that ended before its last configuration (its other figures stand)."""
    if not report["unmeasured"]:
        return ""
    return (f"**Incomplete: the bench ended while measuring `{report['unmeasured'][0]}`; not measured: "
            f"{', '.join(report['unmeasured'])}.**\n")


def loss_text(settings: dict) -> str:
    """The trained loss with the settings that change its work or its value (``--loss`` alone did not say WPO)."""
    text = f"`{settings['loss']}`"
    if settings.get("loss_weights"):
        text += f" weighted {settings['loss_weights']}"
    extras = [f"--{key.replace('_', '-')} {settings[key]:g}" for key in ("ld_alpha", "rpo_alpha")
              if settings.get(key)]
    extras += ["--use-weighting"] if settings.get("use_weighting") else []
    return text + (f" with {', '.join(extras)}" if extras else "")


def _packing_line(report: dict) -> str:
    """What packing gains over padding, next to its ideal."""
    if report["speedup"] is None:
        return "Packing: no `packed` and `padded` pair of runs to compare.\n"
    return (f"**speedup (packed / padded tokens/s): {_fmt(report['speedup'])}**, ideal speedup (padded / packed computed "
            f"tokens): {_fmt(report['ideal_speedup'])}, speedup / ideal: {_fmt(report['speedup_over_ideal'])}.\n")


def _prefix_sharing_line(report: dict) -> str:
    """What computing each prompt once adds to packing, next to its ideal."""
    if report["prefix_sharing_speedup"] is None:
        return f"Prefix sharing: no `packed` and `{UNSHARED}` pair of runs to compare.\n"
    shared, unshared = report["runs"]["packed"], report["runs"][UNSHARED]
    if report["prefix_sharing_speedup"] < report["prefix_sharing_ideal_speedup"]:
        why = ("the gap is work sharing does not shrink: the lm_head over the completion tokens, the rejected tokens' "
               "attention to the prompt, collectives and the optimizer step")
    else:
        why = (f"above the token ideal: the unshared rows also take {_fmt(unshared['rows_per_rank_mean'])} forwards per "
               f"rank and step against {_fmt(shared['rows_per_rank_mean'])}, each gathering the weights again")
    return (f"**prefix sharing (packed / {UNSHARED} pairs/s): {_fmt(report['prefix_sharing_speedup'])}**, ideal "
            f"{_fmt(report['prefix_sharing_ideal_speedup'])} (tokens without sharing / with: "
            f"{shared['prompt_tokens_shared']:,} prompt tokens not run twice), "
            f"{_fmt(unshared['model_flops'] / shared['model_flops'])} by the analytic FLOPs (attention included); "
            f"{why}.\n")


def _prompt_groups_line(report: dict) -> str:
    """What computing each response of a prompt once adds to prefix sharing, next to its ideal (no line without a
    `packed-no-prompt-groups` run: most benches do not measure it)."""
    if report["prompt_groups_speedup"] is None:
        return ""
    return (f"**prompt groups (packed / {GROUPS_OFF} pairs/s): {_fmt(report['prompt_groups_speedup'])}**, ideal "
            f"{_fmt(report['prompt_groups_ideal_speedup'])} (computed tokens pair by pair / grouped).\n")


def _flops_line(report: dict) -> str:
    """What the model FLOPs (and so MFU) count, and the work of the measured steps they leave out."""
    text = ("Model FLOPs (model TFLOP/s, MFU): the policy's forward and backward and the reference's forward of the "
            "computed tokens (`ds_packdpo/model/flops.py`); work repeated to save memory is in the step times but not "
            "in them")
    if report["settings"].get("gradient_checkpointing"):
        text += ", here the second forward of `--gradient-checkpointing`"
    runs = [run for run in report["runs"].values() if run["prepass_flops"]]
    if runs:
        shares = ", ".join(f"{run['name']} {run['prepass_flops'] / run['model_flops']:.0%}" for run in runs)
        text += (f"; **`--loss {report['settings']['loss']}` runs a no-grad policy pre-pass, one more policy forward "
                 f"per row, whose FLOPs are not counted: {shares} on top of the model FLOPs** (`prepass_flops`)")
    elif any(run["prepass_flops"] is None for run in report["runs"].values()):
        text += (f"; `--loss {report['settings']['loss']}` ran a no-grad policy pre-pass whose FLOPs this schema-3 "
                 f"report did not record")
    return text + ".\n"


def _trajectory_line(report: dict) -> str:
    """Whether the configurations of this report trained the same thing (they must: same pairs per step)."""
    diff = report["loss_max_rel_diff"]
    if diff is None:
        return "No two configurations that train the same parameters: no trajectory to compare.\n"
    tolerance = SAME_TRAJECTORY_RTOL[report["settings"]["dtype"]]
    verdict = ("the same trajectory up to rounding" if report["same_trajectory"]
               else "**different trajectories: the configurations did not train the same thing**")
    return (f"Per-step loss of every configuration that trains the same parameters as the first, against the first: "
            f"largest relative difference "
            f"{diff:.2g} (rounding bound for {report['settings']['dtype']}: {tolerance:g}): {verdict}.\n")


# ----------------------------------------------------------------------------- plots

def _bar_labels(ax, bars, values):
    for bar, value in zip(bars, values):
        ax.annotate(f"{value:,.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=8)


def plot_report(report: dict, folder: Path) -> None:
    runs = report["runs"]
    names = list(runs)
    title = f"{Path(report['dataset']).name}, {report['world_size']} ranks, {report['environment']['device_type']}"

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    x = range(len(names))
    real = [runs[n]["tokens_per_s"] for n in names]
    computed = [runs[n]["computed_tokens_per_s"] for n in names]
    _bar_labels(ax, ax.bar([i - 0.2 for i in x], real, 0.4, label="real tokens/s"), real)
    ax.bar([i + 0.2 for i in x], computed, 0.4, label="computed tokens/s (padding in, a shared prompt once)", alpha=0.5)
    ax.set_xticks(list(x), names)
    ax.set_ylabel("tokens / s (all ranks)")
    subtitle = []
    if report["speedup"]:
        subtitle.append(f"speedup {_fmt(report['speedup'])}, ideal {_fmt(report['ideal_speedup'])}")
    if report["prefix_sharing_speedup"]:
        subtitle.append(f"prefix sharing {_fmt(report['prefix_sharing_speedup'])} (pairs/s), ideal "
                        f"{_fmt(report['prefix_sharing_ideal_speedup'])}")
    ax.set_title(f"Throughput: {title}\n{'; '.join(subtitle)}", fontsize=10)
    ax.set_ylim(top=1.2 * max(real + computed))  # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(folder / "tokens_per_s.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], names):
        steps = runs[name]["steps"]
        world = len(steps[0]["rank_tokens"])
        width = 0.8 / world
        for rank in range(world):
            xs = [i + rank * width for i in range(len(steps))]
            ax.bar(xs, [s["rank_computed_tokens"][rank] for s in steps], width, alpha=0.35, color=f"C{rank}")
            ax.bar(xs, [s["rank_tokens"][rank] for s in steps], width, color=f"C{rank}", label=f"rank {rank}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(steps))], [str(s["step"]) for s in steps])
        ax.set_xlabel("step")
        ax.set_title(f"{name}: utilization {runs[name]['utilization']:.2f}", fontsize=10)
    axes[0][0].set_ylabel("tokens per rank (solid: real, light: computed)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "rank_load.png", dpi=110)
    plt.close(fig)

    fig, (left, right) = plt.subplots(1, 2, figsize=(9.0, 3.6))
    first = runs[names[0]]["steps"]
    left.hist([n for s in first for n in s["sequence_lengths"]], bins=30, color="C0")
    left.set_xlabel("sequence length (tokens)")
    left.set_ylabel("sequences")
    left.set_title("sequence lengths of the measured steps", fontsize=10)
    packed = next((n for n in names if runs[n]["packing"]), None)  # configurations share rows for one budget
    fills = [f for s in runs[packed]["steps"] for f in s["row_fill"]] if packed else []
    if fills:
        right.hist(fills, bins=20, range=(0, 1), color="C2")
        right.set_title(f"{packed} row fill (mean {sum(fills) / len(fills):.2f}, budget "
                        f"{report['settings']['row_budget']})", fontsize=10)
    else:
        right.set_title("no packed configuration", fontsize=10)
    right.set_xlabel("row tokens / row budget")
    right.set_ylabel("rows")
    for ax in (left, right):
        ax.yaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    fig.savefig(folder / "lengths.png", dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- merge

def short_name(source: str) -> str:
    """A model or dataset as one machine's path or a hub name: a path's last part, which is the same on two clusters
    that keep the same file in different folders; a hub name (``org/name``) or ``synthetic`` as it is."""
    return Path(source).name if str(source).startswith(("/", ".", "~")) else str(source)


def model_text(model: dict) -> str:
    """A bench folder's model by name and shape (throughput depends on the shape, not on where the file was)."""
    return (f"{short_name(model['source'])} ({model['architecture']}, {model['num_layers']} layers x "
            f"{model['hidden_size']}, {model['num_heads']}/{model['num_kv_heads']} heads, ffn "
            f"{_fmt(model['intermediate_size'])}, vocab {model['vocab_size']:,})")


# entry key -> how a merged report names it; folders that differ in one of these did not measure the same work
COMPARED_KEYS = {"model": "model", "dataset_name": "dataset", "max_length": "max length", "loss": "loss"}


def merge_reports(folders: list[str]) -> dict:
    """One comparison of several bench folders: a row per (folder, configuration), and what the folders differ in."""
    if not folders:
        raise InputError("report: give at least one bench folder")
    entries, incomplete = [], {}
    for folder in folders:
        report = read_report(folder)
        env = report["environment"]
        if report["unmeasured"]:
            incomplete[str(folder)] = report["unmeasured"]
        for name, run in report["runs"].items():
            entries.append({
                "source": str(folder), "configuration": name, "world_size": report["world_size"],
                "sp_size": report["sp_size"],
                "device_type": env["device_type"], "device_name": env["device_name"], "hostname": env["hostname"],
                "dataset": report["dataset"], "dataset_name": short_name(report["dataset"]),
                "model": model_text(report["model"]), "max_length": report["settings"]["max_length"],
                "loss": loss_text(report["settings"]),
                **{k: run[k] for k in ("tokens_per_s", "pairs_per_s", "utilization", "peak_mem_mb",
                                       "model_tflops_per_s", "mfu")},
                "step_time_median_s": run["step_time_s"]["median"],
                "speedup": report["speedup"], "ideal_speedup": report["ideal_speedup"],
            })
    differs_in = [label for key, label in COMPARED_KEYS.items() if len({e[key] for e in entries}) > 1]
    return {"schema_version": SCHEMA_VERSION, "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "sources": [str(f) for f in folders], "differs_in": differs_in, "incomplete": incomplete,
            "entries": entries}


def comparability_line(merged: dict) -> str:
    """One line: whether the folders measured the same work, so that their figures compare (and which benches ended
    before their last configuration)."""
    ended = "".join(f" **{source} ended early: not measured {', '.join(names)}.**"
                    for source, names in merged["incomplete"].items())
    if not merged["differs_in"]:
        return f"Every folder ran the same {', '.join(COMPARED_KEYS.values())}: their figures compare.{ended}\n"
    return (f"**Not comparable: the folders differ in {', '.join(merged['differs_in'])}; their tokens/s, step times "
            f"and MFU measure different work.**{ended}\n")


MERGE_COLUMNS = ("source", "configuration", "model", "dataset_name", "max_length", "loss", "world_size", "sp_size",
                 "device_name", "tokens_per_s", "pairs_per_s", "step_time_median_s", "utilization", "peak_mem_mb",
                 "mfu", "speedup", "ideal_speedup")


def write_merged(merged: dict, out: Path, overwrite: bool = False) -> None:
    def fill(folder: Path) -> None:
        (folder / "merged.json").write_text(json.dumps(merged, indent=1) + "\n")
        rows = [[e[c] for c in MERGE_COLUMNS] for e in merged["entries"]]
        header = [COMPARED_KEYS.get(column, column) for column in MERGE_COLUMNS]
        title = "# ds_packdpo throughput comparison\n\n"
        (folder / "report.md").write_text(title + comparability_line(merged) + "\n" + _table(header, rows)
                                          + "\n![tokens per second](tokens_per_s.png)\n")
        entries = merged["entries"]
        fig, ax = plt.subplots(figsize=(max(6.4, 0.9 * len(entries)), 4.0))
        labels = [f"{Path(e['source']).name}\n{e['configuration']} ({e['world_size']}r)" for e in entries]
        colors = [f"C{merged['sources'].index(e['source']) % 10}" for e in entries]
        values = [e["tokens_per_s"] for e in entries]
        _bar_labels(ax, ax.bar(range(len(entries)), values, color=colors), values)
        ax.set_xticks(range(len(entries)), labels, fontsize=8)
        ax.set_ylabel("real tokens / s (all ranks)")
        ax.set_title("Throughput per bench folder and configuration", fontsize=10)
        fig.tight_layout()
        fig.savefig(folder / "tokens_per_s.png", dpi=110)
        plt.close(fig)

    write_atomically(out, overwrite, fill)
