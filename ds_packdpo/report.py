"""The bench report: ``report.json`` (schema below), ``report.md`` and PNG plots; and the merge of several.

A bench folder holds::

    report.json        the figures (REPORT_SCHEMA / RUN_SCHEMA: every key, always present)
    report.md          the speed-ups measured (``comparisons.py``), then the tables a person reads
    tokens_per_s.png   real and computed tokens/s per configuration (``report_plots.py``)
    rank_load.png      real and computed tokens per rank, one panel per configuration
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

from .bench_rounds import NOISY_SPREAD, five_numbers, median_round, round_entry, spread
from .comparisons import COMPARISONS, PACKED, UNSHARED, comparisons, headline, key_schema, report_keys
from .errors import InputError
from .files import atomic_folder, check_output_folder
from .model.loss_registry import needs_policy_prepass
from .report_plots import PLOTS, plot_merged, plot_report

SCHEMA_VERSION = 8  # 2: the parallel layout, per-step loss and grad norm, the trajectory check; 3: prefix sharing;
# 4: prepass_flops (the aot pre-pass, outside the model FLOPs) and the loss in a merged report; 5: prompt groups'
# speedup; 6: the configurations a bench that ended early did not measure; 7: rounds (the order, each configuration's
# rounds and their spread), failed configurations, the comparisons table (comparisons.py) with every headline
# comparison's speedup_over_ideal, real tokens per rank; 8: a run's lock-step utilization and the prompt tokens it
# copied to spread prompt groups over ranks (null in older reports)
OLDEST_READ_VERSION = 3  # schema 3 lacks prepass_flops (upgrade_schema_3); reports before 7 are one round each, their
# speed-ups recomputed from their runs by the comparisons table (upgrade_before_rounds); 3 to 5 wrote a report only
# once every configuration was measured: clusters benched before still merge
NUMBER = (int, float)
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
    "environment": (dict, "python, torch, deepspeed, transformers, device_type, device_name, hostname, torch_threads, "
                          "torch_threads_per_rank (every rank's), cpu_cores and local_ranks (rank 0's machine)"),
    "settings": (dict, "every train setting, plus bench_warmup_steps, bench_rounds, configurations, row_budget"),
    "runs": (dict, "configuration name -> figures (RUN_SCHEMA); by default packed, packed-no-prefix-sharing, padded "
                   "and, on data whose prompts repeat, packed-no-prompt-groups"),
    "rounds": (int, "rounds asked for (--bench-rounds): every configuration built afresh and measured once per round"),
    "order": (list, "[round, configuration] in the order measured (the order rotated by one each round)"),
    "failed": (dict, "configuration -> {error, round, rank, where, exit_code, blocking_rerun}: a configuration whose "
                     "launch died (ds-packdpo bench then measured the others again without it); where: the failing "
                     "rank's innermost frames; blocking_rerun: {error, where} of its rerun alone with "
                     "CUDA_LAUNCH_BLOCKING=1 after a CUDA error, else null"),
    "comparisons": (list, "one entry per comparison whose two configurations were measured (comparisons.py): name, "
                          "numerator, denominator, rate, speedup, ideal_speedup, speedup_over_ideal, rounds, "
                          "round_speedup_min, round_speedup_median, round_speedup_max (the ratio in each round)"),
    "unmeasured": (list, "configurations asked for with no round measured: the report is rewritten after each "
                         "configuration's round, so a bench that ended early (out of memory, a crash) keeps what it "
                         "measured (report.md's first line says in which configuration and round it ended)"),
    "loss_max_rel_diff": (OPTIONAL_NUMBER, "largest |loss - first configuration's loss| / |first's| over the measured "
                                           "steps of the configurations that train the same parameters as the first "
                                           "(not the LoRA ones of a full fine-tuning first): they train the same pairs, "
                                           "so this is rounding (null when no other configuration compares)"),
    "same_trajectory": ((bool, type(None)), "loss_max_rel_diff is within SAME_TRAJECTORY_RTOL of --dtype (null when "
                                             "no other configuration compares)"),
    **key_schema(OPTIONAL_NUMBER),
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
    "measured_steps": (int, "optimizer steps measured per round (after the warm-up steps)"),
    "tokens_per_s": (NUMBER, "real (non-padding) tokens per second, all ranks, in the median round"),
    "pairs_per_s": (NUMBER, "preference pairs per second, all ranks, in the median round"),
    "computed_tokens_per_s": (NUMBER, "tokens run through the model per second, padding included, median round"),
    "step_time_s": (dict, "median, p90, mean, min, max of the step wall time (slowest rank per step), median round"),
    "rounds": (list, "per round measured: round, position (1 = first of its round), seconds, tokens_per_s, "
                     "pairs_per_s, computed_tokens_per_s, step_time_s (each measured step), loss (each step: the "
                     "same in every round, which rebuilds the configuration from the same seed)"),
    "median_round": (int, "the round whose figures (and steps) the run's are: the median by time"),
    "round_seconds": (dict, "min, q1, median, q3, max of the rounds' measured time"),
    "spread": (NUMBER, "(slowest - fastest round) / median round time; report.md flags a spread above "
                       f"{NOISY_SPREAD:.0%}"),
    "real_tokens": (int, "real tokens of the measured steps (of one round: every round runs the same steps)"),
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
                                              "before schema 8)"),
    "prompt_copy_tokens": ((int, type(None)), "prompt tokens the rows computed beyond one copy per prompt group of a "
                                              "step: what spreading a group's responses over ranks spent on balance "
                                              "(0 without prompt groups; null before schema 8)"),
    "peak_mem_mb": (NUMBER, "highest peak over ranks and rounds, MiB"),
    "peak_mem_mb_per_rank": (list, "peak of each rank over the rounds, MiB"),
    "peak_mem_kind": (str, "'rss' (CPU: the kernel's peak resident set, reset as each round starts), "
                           "'rss_process_peak' (the process's, where it cannot be reset) or 'cuda_max_allocated'"),
    "model_flops": (NUMBER, "analytic model FLOPs of the measured steps (flops.py)"),
    "prepass_flops": (OPTIONAL_NUMBER, "analytic FLOPs of the no-grad policy pre-pass of --loss aot/aot_unpaired (one "
                                       "more policy forward per row) in the measured steps, 0 without it: its time is "
                                       "in the step times, but not in model_flops, model_tflops_per_s or mfu (null: a "
                                       "schema-3 report of such a loss, which did not record it)"),
    "model_tflops_per_s": (NUMBER, "model_flops / measured time / 1e12, all ranks"),
    "mfu": (OPTIONAL_NUMBER, "model_tflops_per_s / (peak_tflops x world_size); null without --peak-tflops"),
    "steps": (list, "per measured step of the median round: step, step_time_s, loss, grad_norm, pairs, real_tokens, "
                    "computed_tokens, prompt_tokens_shared, rows_per_rank, rank_real_tokens (the real tokens of the pair "
                    "sides each data-parallel share computes), rank_tokens and rank_computed_tokens (per data-parallel share; a "
                    "shared prompt once), lockstep_tokens (sum over row slots of the largest row), prompt_copy_tokens, "
                    "attention_sq, flops, prepass_flops, row_fill, sequence_lengths"),
}


# Settings that change which parameters a configuration trains: such a configuration follows its own trajectory.
TRAINED_PARAMETER_SETTINGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")


def _trained_parameters(run: dict) -> dict:
    return {key: run["overrides"].get(key) for key in TRAINED_PARAMETER_SETTINGS}


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
                 runs: dict, unmeasured: tuple[str, ...] = (), rounds: int = 1, order: tuple = (),
                 failed: dict | None = None) -> dict:
    """``layout``: the run's ParallelLayout.as_dict() (world_size, dp_size, sp_size); ``unmeasured``: the
    configurations still to measure when it is written; ``order``: (round, configuration) as measured; ``failed``:
    the configurations whose launch died (``bench_front.py``)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command, **layout, "dataset": dataset, "model": model,
        "environment": environment, "settings": settings, "runs": runs, "unmeasured": list(unmeasured),
        "rounds": rounds, "order": [list(entry) for entry in order], "failed": dict(failed or {}),
        **figures_of_runs(runs, settings["dtype"]),
    }


def figures_of_runs(runs: dict, dtype: str) -> dict:
    """What a report derives from its runs: the trajectory check, the speed-up keys and the comparisons list."""
    diff = loss_max_rel_diff(runs) if runs else None
    return {"loss_max_rel_diff": diff, "same_trajectory": None if diff is None else diff <= SAME_TRAJECTORY_RTOL[dtype],
            **report_keys(runs), "comparisons": comparisons(runs)}


def with_failures(report: dict, failed: dict) -> dict:
    """``report`` with the configurations of ``failed`` marked failed: their runs (of rounds measured before the
    crash) left out, the speed-ups and the trajectory check recomputed without them."""
    runs = {name: run for name, run in report["runs"].items() if name not in failed}
    return {**report, "runs": runs, "failed": {**report["failed"], **failed},
            "unmeasured": [name for name in report["unmeasured"] if name not in failed],
            **figures_of_runs(runs, report["settings"]["dtype"])}


def run_rounds(steps_of_rounds: list[list[dict]], positions: list[int]) -> dict:
    """A configuration's round figures (RUN_SCHEMA's rounds, median_round, round_seconds, spread) from the steps of
    each round it ran (``positions``: its place in each round, 1 = first)."""
    rounds = [round_entry(number, position, steps)
              for number, (position, steps) in enumerate(zip(positions, steps_of_rounds), start=1)]
    return {"rounds": rounds, "median_round": rounds[median_round(rounds)]["round"],
            "round_seconds": five_numbers([entry["seconds"] for entry in rounds]), "spread": spread(rounds)}


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
    before_rounds = isinstance(version, int) and version < 7
    if isinstance(version, int) and version < 6:  # written complete or not at all
        report["unmeasured"] = []
    if before_rounds:  # one round each; the speed-ups from its runs once they are checked
        report.update({"rounds": 1, "order": [], "failed": {}, "comparisons": [],
                       **dict.fromkeys(key for row in COMPARISONS for key in row.keys)})
    if isinstance(version, int) and version < 8:  # not recorded
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
    if before_rounds:
        upgrade_before_rounds(report, source)
    for name, run in report["runs"].items():
        check(run, RUN_SCHEMA, f"runs.{name}.")
    return report


def upgrade_before_rounds(report: dict, source: str) -> None:
    """A report of schema 3 to 6 in schema 7's form: each configuration measured in one round (its steps), in the
    order of its runs; the speed-ups recomputed from the runs by the comparisons table (the same ratios they held,
    and the ones they lacked: the prompt groups' before schema 5, every speedup_over_ideal but packing's)."""
    for name, run in report["runs"].items():
        steps = run.get("steps")
        if not isinstance(steps, list) or not steps or not all(isinstance(step, dict) for step in steps):
            raise InputError(f"{source}: runs.{name}.steps is not a list of measured steps")
        try:
            run.update(run_rounds([steps], [len(report["order"]) + 1]))
        except (KeyError, TypeError, ZeroDivisionError):
            raise InputError(f"{source}: runs.{name}.steps lack a step's time, tokens or pairs") from None
        report["order"].append([1, name])
    report.update(report_keys(report["runs"]))
    report["comparisons"] = comparisons(report["runs"])


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
               ("rounds", lambda r: len(r["rounds"])), ("spread", lambda r: f"{r['spread']:.0%}"),
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
        _failed_lines(report),
        _unmeasured_line(report),
        speedup_lines(report),
        _noise_lines(report),
        f"{report['world_size']} ranks ({report['dp_size']} data-parallel x {report['sp_size']} sequence-parallel) on "
        f"{env['device_type']} ({env['device_name']}, host {env['hostname']}, {_threads_text(env)}); torch "
        f"{env['torch']}, deepspeed {env['deepspeed']}, transformers {env['transformers']}.\n",
        _oversubscribed_line(report),
        f"Model: {model['architecture']} from `{model['source']}`: hidden {model['hidden_size']}, {model['num_layers']} "
        f"layers, {model['num_heads']} heads ({model['num_kv_heads']} KV), vocab {model['vocab_size']}.\n",
        f"Settings: max length {settings['max_length']}, row budget {settings['row_budget']}, "
        f"{settings['global_batch_pairs']} pairs per step, padded micro-batch {settings['micro_batch_pairs']} pairs, "
        f"{settings['dtype']}, `{settings['ds_config']}`; loss {loss_text(settings)}.\n",
        _rounds_line(report),
        _prefix_sharing_line(report),
        _table([c for c, _ in RUN_COLUMNS], [[get(r) for _, get in RUN_COLUMNS] for r in runs]) if runs else "",
        _flops_line(report) if runs else "",
        _trajectory_line(report),
        f"\nCommand: `{report['command']}`\n",
        "\n" + "".join(f"![{p}]({p})\n" for p in PLOTS),
    ]
    return "\n".join(line for line in text if line)


def speedup_lines(report: dict) -> str:
    """What report.md opens with: every speed-up the run measured, each beside its token ideal."""
    if not report["comparisons"]:
        return "No comparison measured: no two configurations of one (`ds_packdpo/comparisons.py`) were both run.\n"
    return ("Speed-ups measured (each configuration's figures are those of its median round; each speed-up beside its "
            "token ideal, the ratio of the tokens the two configurations computed):\n\n"
            + "".join(f"- {headline(figures, bold=True)}\n" for figures in report["comparisons"]))


def _noise_lines(report: dict) -> str:
    """A bold line per configuration whose rounds spread more than NOISY_SPREAD of their median time."""
    lines = []
    for run in report["runs"].values():
        if len(run["rounds"]) > 1 and run["spread"] > NOISY_SPREAD:
            seconds = run["round_seconds"]
            lines.append(f"**Noisy: `{run['name']}` took {_fmt(seconds['min'])}-{_fmt(seconds['max'])} s per round over "
                         f"{len(run['rounds'])} rounds, a spread of {run['spread']:.0%} of its median "
                         f"({_fmt(seconds['median'])} s), more than {NOISY_SPREAD:.0%}: its figures, and the speed-ups "
                         f"it is in, are not known better than that (a busy machine?); rerun on a quiet machine or with "
                         f"more --bench-rounds.**\n")
    return "\n".join(lines)


def _rounds_line(report: dict) -> str:
    """How the configurations were measured: rounds, their order, the steps of each."""
    settings = report["settings"]
    order: dict[int, list[str]] = {}
    for number, name in report["order"]:
        order.setdefault(number, []).append(name)
    shown = "; ".join(f"round {number}: {', '.join(names)}" for number, names in list(order.items())[:3])
    more = "; ..." if len(order) > 3 else ""
    return (f"Measured in {report['rounds']} round{'s' if report['rounds'] != 1 else ''} of "
            f"{settings['bench_warmup_steps']} warm-up + {settings['max_steps']} measured steps per configuration, each "
            f"configuration built afresh from the same seed in every round, the order rotated each round ({shown}{more})"
            f".\n")


def _threads_text(env: dict) -> str:
    threads = env.get("torch_threads_per_rank") or [env["torch_threads"]]
    per_rank = (f"{threads[0]} torch threads per rank" if len(set(threads)) == 1
                else f"torch threads per rank {', '.join(map(str, threads))}")
    return per_rank + (f" on {env['cpu_cores']} cores" if env.get("cpu_cores") else "")


def _oversubscribed_line(report: dict) -> str:
    """Said in bold when the CPU ranks of rank 0's machine run more torch threads than it has cores."""
    env = report["environment"]
    threads, cores = env.get("torch_threads_per_rank"), env.get("cpu_cores")
    if env["device_type"] != "cpu" or not threads or not cores:
        return ""
    local = env.get("local_ranks") or len(threads)
    if local * max(threads) <= cores:
        return ""
    return (f"**Oversubscribed: {local} ranks x {max(threads)} torch threads on {cores} cores: the ranks' threads "
            f"compete for the cores and the step times say more about the scheduler than the step (set "
            f"OMP_NUM_THREADS; `ds-packdpo bench` gives each rank cores / ranks).**\n")


def _failed_lines(report: dict) -> str:
    """Said first: configurations whose launch died, with the error, and the others measured again without them."""
    lines = []
    for name, failure in report["failed"].items():
        blocking = failure.get("blocking_rerun")
        rerun = ""
        if blocking:
            where = f" at {blocking['where']}" if blocking.get("where") else ""
            rerun = f"; alone with CUDA_LAUNCH_BLOCKING=1: {blocking['error']}{where}"
        rank = f", rank {failure['rank']}" if failure.get("rank") is not None else ""
        lines.append(f"**Failed: `{name}` (round {failure['round']}{rank}): {failure['error']}{rerun}.** The other "
                     f"configurations were measured again without it.\n")
    return "\n".join(lines)


def _unmeasured_line(report: dict) -> str:
    """Said first: a bench that ended before its last configuration's last round (its other figures stand)."""
    order, done = report["order"], sum(len(run["rounds"]) for run in report["runs"].values())
    never = f"; not measured at all: {', '.join(report['unmeasured'])}" if report["unmeasured"] else ""
    if done < len(order):
        number, name = order[done]
        return (f"**Incomplete: the bench ended while measuring `{name}` in round {number} of {report['rounds']} "
                f"({done} of {len(order)} configuration rounds measured){never}.**\n")
    if report["unmeasured"]:  # a report before rounds: its order lists what it measured
        return f"**Incomplete: the bench ended while measuring `{report['unmeasured'][0]}`{never}.**\n"
    return ""


def loss_text(settings: dict) -> str:
    """The trained loss with the settings that change its work or its value (``--loss`` alone did not say WPO)."""
    text = f"`{settings['loss']}`"
    if settings.get("loss_weights"):
        text += f" weighted {settings['loss_weights']}"
    extras = [f"--{key.replace('_', '-')} {settings[key]:g}" for key in ("ld_alpha", "rpo_alpha")
              if settings.get(key)]
    extras += ["--use-weighting"] if settings.get("use_weighting") else []
    return text + (f" with {', '.join(extras)}" if extras else "")


def _prefix_sharing_line(report: dict) -> str:
    """Why prefix sharing's speed-up is off its token ideal (its figure is among the speed-ups above)."""
    if report["prefix_sharing_speedup"] is None:
        return ""
    shared, unshared = report["runs"][PACKED], report["runs"][UNSHARED]
    if report["prefix_sharing_speedup"] < report["prefix_sharing_ideal_speedup"]:
        why = ("the gap is work sharing does not shrink: the lm_head over the completion tokens, the rejected tokens' "
               "attention to the prompt, collectives and the optimizer step")
    else:
        why = (f"above the token ideal: the unshared rows also take {_fmt(unshared['rows_per_rank_mean'])} forwards per "
               f"rank and step against {_fmt(shared['rows_per_rank_mean'])}, each gathering the weights again")
    return (f"Prefix sharing: {shared['prompt_tokens_shared']:,} prompt tokens not run twice; "
            f"{_fmt(unshared['model_flops'] / shared['model_flops'])}x by the analytic FLOPs (attention included); "
            f"{why}.\n")


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
    """One comparison of several bench folders: a row per (folder, configuration), a row per (folder, comparison),
    and what the folders differ in."""
    if not folders:
        raise InputError("report: give at least one bench folder")
    entries, speedups, incomplete, failed = [], [], {}, {}
    for folder in folders:
        report = read_report(folder)
        env = report["environment"]
        if report["unmeasured"]:
            incomplete[str(folder)] = report["unmeasured"]
        if report["failed"]:
            failed[str(folder)] = {name: failure["error"] for name, failure in report["failed"].items()}
        for name, run in report["runs"].items():
            entries.append({
                "source": str(folder), "configuration": name, "world_size": report["world_size"],
                "sp_size": report["sp_size"],
                "device_type": env["device_type"], "device_name": env["device_name"], "hostname": env["hostname"],
                "dataset": report["dataset"], "dataset_name": short_name(report["dataset"]),
                "model": model_text(report["model"]), "max_length": report["settings"]["max_length"],
                "loss": loss_text(report["settings"]),
                **{k: run[k] for k in ("tokens_per_s", "pairs_per_s", "utilization", "peak_mem_mb",
                                       "model_tflops_per_s", "mfu", "spread")},
                "rounds": len(run["rounds"]), "step_time_median_s": run["step_time_s"]["median"],
            })
        speedups += [{"source": str(folder), "world_size": report["world_size"], **figures}
                     for figures in report["comparisons"]]
    differs_in = [label for key, label in COMPARED_KEYS.items() if len({e[key] for e in entries}) > 1]
    return {"schema_version": SCHEMA_VERSION, "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "sources": [str(f) for f in folders], "differs_in": differs_in, "incomplete": incomplete,
            "failed": failed, "entries": entries, "comparisons": speedups}


def comparability_line(merged: dict) -> str:
    """One line: whether the folders measured the same work, so that their figures compare (and which benches ended
    before their last configuration, or lost one)."""
    ended = "".join(f" **{source} ended early: not measured {', '.join(names)}.**"
                    for source, names in merged["incomplete"].items())
    ended += "".join(f" **{source} lost {', '.join(f'{name} ({error})' for name, error in lost.items())}.**"
                     for source, lost in merged.get("failed", {}).items())
    if not merged["differs_in"]:
        return f"Every folder ran the same {', '.join(COMPARED_KEYS.values())}: their figures compare.{ended}\n"
    return (f"**Not comparable: the folders differ in {', '.join(merged['differs_in'])}; their tokens/s, step times "
            f"and MFU measure different work.**{ended}\n")


MERGE_COLUMNS = ("source", "configuration", "model", "dataset_name", "max_length", "loss", "world_size", "sp_size",
                 "device_name", "tokens_per_s", "pairs_per_s", "rounds", "spread", "step_time_median_s",
                 "utilization", "peak_mem_mb", "mfu")
SPEEDUP_COLUMNS = ("source", "world_size", "name", "numerator", "denominator", "speedup", "round_speedup_min",
                   "round_speedup_max", "ideal_speedup", "speedup_over_ideal")


def merged_markdown(merged: dict) -> str:
    """The merged report.md: whether the folders compare, every folder's speed-ups (the comparisons table), then
    every folder's configurations."""
    speedups = [[e[c] for c in SPEEDUP_COLUMNS] for e in merged["comparisons"]]
    rows = [[f"{e[c]:.0%}" if c == "spread" else e[c] for c in MERGE_COLUMNS] for e in merged["entries"]]
    return ("# ds_packdpo throughput comparison\n\n" + comparability_line(merged)
            + ("\nSpeed-ups (round min and max: the speed-up in the folder's fastest- and slowest-ratio round):\n\n"
               + _table(["source", "ranks", "comparison", "numerator", "denominator", "speedup", "round min",
                         "round max", "token ideal", "speedup / ideal"], speedups) if speedups else "")
            + "\n" + _table([COMPARED_KEYS.get(column, column) for column in MERGE_COLUMNS], rows)
            + "\n![tokens per second](tokens_per_s.png)\n")


def write_merged(merged: dict, out: Path, overwrite: bool = False) -> None:
    def fill(folder: Path) -> None:
        (folder / "merged.json").write_text(json.dumps(merged, indent=1) + "\n")
        (folder / "report.md").write_text(merged_markdown(merged))
        plot_merged(merged, folder)

    write_atomically(out, overwrite, fill)
