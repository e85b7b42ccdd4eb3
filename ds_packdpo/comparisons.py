"""The bench's comparisons: every speed-up a report states is one row of :data:`COMPARISONS`.

A row names the configuration whose rate is divided (the numerator), the one it is divided by (the denominator),
the rate (real tokens/s or pairs/s; over the same steps both give the same ratio) and, for the speed-ups reports
have carried since schema 5, the prefix of their ``report.json`` keys.  Everything that states a speed-up is
generated from these rows: ``report.json``'s keys and its ``comparisons`` list, the opening lines of ``report.md``,
the throughput plot's subtitle, the merged report's table and the bench's printout.  A new comparison is one row.

Each figure stands beside its token ideal: the denominator's computed tokens over the numerator's, the speed-up if
time were proportional to the tokens the model runs (1.0 where both run the same tokens, e.g. a LoRA run against a
full one: the gain is then the work per token).  With several rounds (``bench.py``) the speed-up of each round is
the ratio of the two configurations' figures in that round, measured side by side; their spread is reported.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

PACKED = "packed"
PADDED = "padded"
UNSHARED = "packed-no-prefix-sharing"  # packing alone: the baseline of prefix sharing
GROUPS_OFF = "packed-no-prompt-groups"  # prefix sharing pair by pair: the baseline of prompt groups


@dataclass(frozen=True)
class Comparison:
    name: str  # what is compared, as report.md says it
    numerator: str  # configuration names (bench.CONFIGURATIONS)
    denominator: str
    rate: str  # the run figure divided: "tokens_per_s" or "pairs_per_s"
    key_prefix: str | None  # report.json's f"{prefix}speedup", f"{prefix}ideal_speedup", f"{prefix}speedup_over_ideal"
    meaning: str  # what the speed-up measures, in one phrase

    @property
    def keys(self) -> tuple[str, str, str] | tuple[()]:
        """(speedup, ideal, speedup over ideal) keys at the top of report.json; none for a row without a prefix."""
        if self.key_prefix is None:
            return ()
        return f"{self.key_prefix}speedup", f"{self.key_prefix}ideal_speedup", f"{self.key_prefix}speedup_over_ideal"

    @property
    def ratio_text(self) -> str:
        return f"{self.numerator} / {self.denominator} {RATE_NAMES[self.rate]}"


RATE_NAMES = {"tokens_per_s": "tokens/s", "pairs_per_s": "pairs/s"}

COMPARISONS = (
    Comparison("packing", PACKED, PADDED, "tokens_per_s", "",
               "packed rows of whole pairs against padded micro-batches"),
    Comparison("prefix sharing", PACKED, UNSHARED, "pairs_per_s", "prefix_sharing_",
               "each pair's prompt computed once against once per sequence"),
    Comparison("prompt groups", PACKED, GROUPS_OFF, "pairs_per_s", "prompt_groups_",
               "each prompt and response of a prompt group computed once against once per pair"),
    Comparison("lean log-probs", PACKED, "packed-plain-logps", "pairs_per_s", None,
               "per-sequence log-probs from chunks of the lm_head against the whole [tokens x vocab] logits"),
    Comparison("precomputed reference", "packed-precomputed-ref", PACKED, "pairs_per_s", None,
               "reference log-probs read from a file against a reference forward per row"),
    Comparison("varlen attention", UNSHARED, "packed-sdpa-dense", "pairs_per_s", None,
               "attention per sequence against sdpa's dense block-diagonal mask (packing alone)"),
    Comparison("attention kernel", PACKED, "packed-sdpa-varlen", "pairs_per_s", None,
               "the run's --attn against the per-sequence sdpa loop"),
    Comparison("LoRA", "packed-lora", PACKED, "pairs_per_s", None,
               "LoRA adapters (r 8) against training every weight"),
)
# The key prefixes of schema 6 (speedup_over_ideal only for packing then).
LEGACY_KEYS = ("speedup", "ideal_speedup", "speedup_over_ideal", "prefix_sharing_speedup",
               "prefix_sharing_ideal_speedup", "prompt_groups_speedup", "prompt_groups_ideal_speedup")


def _ratio(numerator, denominator):
    return numerator / denominator if numerator is not None and denominator else None


def round_rates(run: dict, rate: str) -> dict[int, float]:
    """The run's ``rate`` in each of its rounds (round number -> figure); one round for a report without rounds."""
    return {entry["round"]: entry[rate] for entry in run["rounds"]}


def compare(comparison: Comparison, runs: dict) -> dict | None:
    """The row's figures on ``runs`` (None unless both configurations were measured): the speed-up of the runs'
    figures (each the median round's), its ideal, and the spread of the speed-ups of the rounds both measured."""
    numerator, denominator = runs.get(comparison.numerator), runs.get(comparison.denominator)
    if numerator is None or denominator is None:
        return None
    speedup = _ratio(numerator[comparison.rate], denominator[comparison.rate])
    ideal = _ratio(denominator["computed_tokens"], numerator["computed_tokens"])
    top, bottom = round_rates(numerator, comparison.rate), round_rates(denominator, comparison.rate)
    paired = sorted(top[r] / bottom[r] for r in top if r in bottom and bottom[r])
    return {"name": comparison.name, "numerator": comparison.numerator, "denominator": comparison.denominator,
            "rate": comparison.rate, "speedup": speedup, "ideal_speedup": ideal,
            "speedup_over_ideal": _ratio(speedup, ideal),
            "rounds": len(paired), "round_speedup_min": paired[0] if paired else None,
            "round_speedup_median": statistics.median(paired) if paired else None,
            "round_speedup_max": paired[-1] if paired else None}


def comparisons(runs: dict) -> list[dict]:
    """Every row whose two configurations were measured, in the table's order."""
    return [figures for figures in (compare(row, runs) for row in COMPARISONS) if figures is not None]


def report_keys(runs: dict) -> dict:
    """report.json's top-level speed-up keys (null where a row's configurations were not both measured)."""
    keys = {}
    for row in COMPARISONS:
        figures = compare(row, runs)
        for key, figure in zip(row.keys, ("speedup", "ideal_speedup", "speedup_over_ideal")):
            keys[key] = figures[figure] if figures else None
    return keys


def key_schema(optional_number) -> dict:
    """The REPORT_SCHEMA entries of the rows' top-level keys."""
    schema = {}
    for row in COMPARISONS:
        if row.key_prefix is None:
            continue
        speedup, ideal, over = row.keys
        schema[speedup] = (optional_number, f"runs['{row.numerator}'].{row.rate} / runs['{row.denominator}']."
                                            f"{row.rate}: {row.meaning} (null without both)")
        schema[ideal] = (optional_number, f"runs['{row.denominator}'].computed_tokens / runs['{row.numerator}']."
                                          f"computed_tokens: the speed-up if time were proportional to computed "
                                          f"tokens (null without both)")
        schema[over] = (optional_number, f"{speedup} / {ideal}")
    return schema


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def spread_text(figures: dict) -> str:
    """`` (1.9-2.1 over 3 rounds)``: the speed-ups of the rounds; empty with one round."""
    if figures["rounds"] < 2:
        return ""
    return (f" ({_fmt(figures['round_speedup_min'])}-{_fmt(figures['round_speedup_max'])} over "
            f"{figures['rounds']} rounds)")


def headline(figures: dict, bold: bool = False) -> str:
    """One comparison in one line: ``packing (packed / padded tokens/s): 2.24x (2.1-2.3 over 3 rounds), token
    ideal 2.17x (1.03 of it)``; ``bold``: its figure in Markdown bold."""
    row = next(row for row in COMPARISONS if row.name == figures["name"])
    lead = f"{figures['name']} ({row.ratio_text}): {_fmt(figures['speedup'])}x"
    return (f"{f'**{lead}**' if bold else lead}{spread_text(figures)}, token ideal {_fmt(figures['ideal_speedup'])}x "
            f"({_fmt(figures['speedup_over_ideal'])} of it)")


def short_headline(figures: dict) -> str:
    """A comparison for a plot's subtitle: ``packing 2.24x (ideal 2.17x)``."""
    return f"{figures['name']} {_fmt(figures['speedup'])}x (ideal {_fmt(figures['ideal_speedup'])}x)"
