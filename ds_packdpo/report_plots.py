"""The bench's plots: every drawn series is a figure of report.json, and the text on a plot is the figure of what it
draws.

``tokens_per_s.png``  real and computed tokens/s of each configuration (its median round), the slowest and fastest
                      round as error bars, a number on every bar, the measured speed-ups in the subtitle
``rank_load.png``     per configuration, each rank's real tokens and computed tokens (not padding / padding) over the
                      measured steps, a number on every bar; the title's utilization and balance are those of the bars
``lengths.png``       the sequence-length histogram and the fill of the packed rows

Every legend sits outside the axes, so no value label can fall under it (tests/test_bench.py checks both with the
renderer's boxes, and reads each plot's bars back against report.json).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from .comparisons import short_headline

matplotlib.use("Agg")  # files only, no display

PLOTS = ("tokens_per_s.png", "rank_load.png", "lengths.png")
REAL = "C0"
COMPUTED = "C1"
LABEL_SIZE = 7


def number_label(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _label_bars(ax, bars, values, tops=None) -> None:
    """The number of each bar above it (above ``tops``, e.g. its error bar, when given)."""
    for index, (bar, value) in enumerate(zip(bars, values)):
        top = bar.get_y() + bar.get_height() if tops is None else tops[index]
        ax.annotate(number_label(value), (bar.get_x() + bar.get_width() / 2, top), xytext=(0, 2),
                    textcoords="offset points", ha="center", va="bottom", fontsize=LABEL_SIZE)


def _place_legend(fig, handles, labels, columns: int = 1):
    """One legend below the axes (constrained layout makes room for it), its labels wrapped to the figure's width."""
    width = int(fig.get_figwidth() * 72 / 8 / 0.6 / columns) - 6  # characters of 8-point text across the figure
    return fig.legend(handles, ["\n".join(textwrap.wrap(label, width)) for label in labels], loc="outside lower center",
                      ncols=columns, fontsize=8, frameon=False)


def _empty(fig, ax, what: str):
    ax.text(0.5, 0.5, f"no configuration measured: no {what}", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()
    return fig


def _title(report: dict) -> str:
    return f"{Path(report['dataset']).name}, {report['world_size']} ranks, {report['environment']['device_type']}"


def tokens_per_s_figure(report: dict):
    """Real and computed tokens/s per configuration, the spread of the rounds as error bars, the speed-ups above."""
    runs = report["runs"]
    names = list(runs)
    fig, ax = plt.subplots(figsize=(max(6.4, 1.7 * len(names)), 5.0), layout="constrained")
    if not names:
        return _empty(fig, ax, "throughput")
    rounds = max(len(run["rounds"]) for run in runs.values())
    width = 0.38
    whiskers = None
    for offset, key, color, hatch in ((-width / 2, "tokens_per_s", REAL, None),
                                      (width / 2, "computed_tokens_per_s", COMPUTED, "//")):
        values = [runs[name][key] for name in names]
        spans = [[entry[key] for entry in runs[name]["rounds"]] for name in names]
        low = [value - min(span) for value, span in zip(values, spans)]
        high = [max(span) - value for value, span in zip(values, spans)]
        bars = ax.bar([i + offset for i in range(len(names))], values, width, color=color, hatch=hatch,
                      edgecolor="white" if hatch else None, yerr=[low, high], capsize=3, ecolor="0.3")
        _label_bars(ax, bars, values, tops=[value + up for value, up in zip(values, high)])
        whiskers = bars.errorbar
    ax.set_xticks(range(len(names)), names, rotation=15, ha="right", fontsize=8)
    ax.set_ylabel("tokens / s (all ranks)")
    ax.margins(y=0.15)
    speedups = [short_headline(figures) for figures in report["comparisons"]]
    subtitle = "\n".join(textwrap.wrap("; ".join(speedups), 95)) if speedups else "no speed-up measured"
    ax.set_title(f"Throughput: {_title(report)}\n{subtitle}", fontsize=9)
    handles = [Patch(color=REAL), Patch(facecolor=COMPUTED, hatch="//", edgecolor="white")]
    labels = ["real tokens/s: the tokens of the pairs, every sequence whole (its prompt included)",
              "computed tokens/s: the tokens the model ran (padding included, a shared prompt once)"]
    if rounds > 1:
        handles.append(whiskers)
        labels.append(f"bar: the median round of {rounds}; whiskers: the slowest and the fastest round")
    _place_legend(fig, handles, labels)
    return fig


def rank_totals(run: dict) -> dict:
    """Per rank (data-parallel share) over the run's measured steps: real tokens (None in a report before schema 7,
    which did not record them), computed tokens that are not padding, padding; what rank_load.png draws."""
    steps = run["steps"]
    shares = range(len(steps[0]["rank_computed_tokens"]))
    recorded = all("rank_real_tokens" in step for step in steps)
    real = [sum(step["rank_real_tokens"][r] for step in steps) for r in shares] if recorded else None
    laid_out = [sum(step["rank_tokens"][r] for step in steps) for r in shares]
    computed = [sum(step["rank_computed_tokens"][r] for step in steps) for r in shares]
    return {"real": real, "not_padding": laid_out, "padding": [c - t for c, t in zip(computed, laid_out)],
            "computed": computed}


def rank_load_title(name: str, totals: dict, worst_step: float) -> str:
    """The panel's title: the utilization and the balance of the bars it draws (and the worst step's balance)."""
    computed = totals["computed"]
    utilization = sum(totals["not_padding"]) / sum(computed)
    balance = max(computed) / (sum(computed) / len(computed))
    return (f"{name}\nutilization {utilization:.3f} (not padding / computed)\ncomputed max/mean over ranks "
            f"{balance:.3f} (worst step {worst_step:.3f})")


def rank_load_figure(report: dict):
    """Each rank's real and computed tokens over the measured steps, one panel per configuration."""
    runs = report["runs"]
    names = list(runs)
    fig, axes = plt.subplots(1, max(len(names), 1), figsize=(max(4.2 * len(names), 6.4), 4.6), sharey=True,
                             squeeze=False, layout="constrained")
    if not names:
        return _empty(fig, axes[0][0], "rank load")
    share = "rank" if report["sp_size"] == 1 else "data-parallel share"
    real_drawn = False
    for ax, name in zip(axes[0], names):
        totals = rank_totals(runs[name])
        ranks = range(len(totals["computed"]))
        width = 0.38
        if totals["real"] is not None:
            real_drawn = True
            real = ax.bar([r - width / 2 for r in ranks], totals["real"], width, facecolor="none", edgecolor=REAL,
                          hatch="xx", linewidth=1.2)
            _label_bars(ax, real, totals["real"])
        ax.bar([r + width / 2 for r in ranks], totals["not_padding"], width, color=COMPUTED)
        computed = ax.bar([r + width / 2 for r in ranks], totals["padding"], width, bottom=totals["not_padding"],
                          color=COMPUTED, alpha=0.35)
        _label_bars(ax, computed, totals["computed"])
        ax.set_xticks(list(ranks), [f"{share} {r}" for r in ranks], fontsize=8)
        ax.margins(y=0.12)
        ax.set_title(rank_load_title(name, totals, runs[name]["rank_load_max_over_mean"]), fontsize=9)
    axes[0][0].set_ylabel(f"tokens over {len(runs[names[0]]['steps'])} measured steps")
    handles = [Patch(color=COMPUTED), Patch(color=COMPUTED, alpha=0.35)]
    labels = ["computed, not padding: what the model ran of them (a shared prompt once)",
              "computed, padding: tokens run that hold no data"]
    if real_drawn:  # a report before schema 7 did not record them
        handles.insert(0, Patch(facecolor="none", edgecolor=REAL, hatch="xx"))
        labels.insert(0, f"real tokens: the tokens of the {share}'s pairs, every sequence whole (its prompt included)")
    _place_legend(fig, handles, labels)
    return fig


def lengths_figure(report: dict):
    """The sequence lengths of the measured steps, and how full the packed rows were."""
    runs = report["runs"]
    names = list(runs)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.0, 3.6), layout="constrained")
    if not names:
        return _empty(fig, left, "lengths")
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
    return fig


FIGURES = {"tokens_per_s.png": tokens_per_s_figure, "rank_load.png": rank_load_figure,
           "lengths.png": lengths_figure}


def plot_report(report: dict, folder: Path) -> None:
    for name, figure in FIGURES.items():
        fig = figure(report)
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)


def merged_figure(merged: dict):
    """Real tokens/s per (folder, configuration), a colour per folder, a number on every bar."""
    entries = merged["entries"]
    fig, ax = plt.subplots(figsize=(max(6.4, 1.0 * len(entries)), 4.8), layout="constrained")
    labels = [f"{entry['configuration']}\n{entry['world_size']} ranks" for entry in entries]
    colors = [f"C{merged['sources'].index(entry['source']) % 10}" for entry in entries]
    values = [entry["tokens_per_s"] for entry in entries]
    _label_bars(ax, ax.bar(range(len(entries)), values, color=colors), values)
    ax.set_xticks(range(len(entries)), labels, fontsize=7)
    ax.set_ylabel("real tokens / s (all ranks)")
    ax.margins(y=0.12)
    ax.set_title("Throughput per bench folder and configuration (each its median round)", fontsize=10)
    hosts = {entry["source"]: f"{entry['device_name']}, {entry['world_size']} ranks" for entry in entries}
    _place_legend(fig, [Patch(color=f"C{i % 10}") for i, _ in enumerate(merged["sources"])],
                  [f"{source} ({hosts.get(source, 'nothing measured')})" for source in merged["sources"]])
    return fig


def plot_merged(merged: dict, folder: Path) -> None:
    fig = merged_figure(merged)
    fig.savefig(folder / "tokens_per_s.png", dpi=110)
    plt.close(fig)
