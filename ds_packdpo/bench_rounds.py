"""The bench's rounds: every configuration measured once per round, round after round, in one process.

Why rounds. Configurations measured one after the other in one process did not measure the same thing: the first
paid for the process's history (issue 41: packed took 1.39 s per step when first, 0.92 s when second). What was
measured here: with glibc's allocator left to tune itself, the first configuration of a process kept taking page
faults in its measured steps (a median 17,800 per step and rank on dpo_en_demo, 8,192-token rows, up to 74,000)
where the same configuration measured second took almost none (a median 5), because glibc raises its mmap and trim
thresholds only as it sees large blocks freed; threads per rank were the same in both orders (1), and no other
thread or process of the bench used more than 3% of a core (the peak-RSS sampling thread, since replaced by the
kernel's own peak: ``run/cpu_memory.py``). The allocator is now fixed at start-up and trimmed between configurations
(``run/cpu_memory.py``), so each configuration starts from the same state; rounds make what is left (a machine whose
load drifts, first-use costs of a process) visible and averaged out instead of charged to whichever configuration
ran first.  Whether the faults were all of issue 41's 0.47 s per step is for a quiet machine to say: under the load
of other jobs here, the CPU time of a measured step did not differ measurably between the orders (docs/benchmarks.md
gives the commands).

The design.  Each round builds every configuration afresh (same seed, same steps: the engines of one configuration
round are freed before the next is built), runs ``--bench-warmup-steps`` unmeasured steps and ``--max-steps``
measured ones: every round of a configuration is the same work, so the spread of its rounds is the noise of the
measurement alone, and the loss of each step is the same in every round (a test checks it).  Keeping every
configuration's engines alive instead would let steps interleave more finely, but holds every configuration's
weights and optimizer states at once: a bench that fits one configuration at a time (a large model on a GPU) would
run out of memory.  The order is rotated by one configuration each round (A B C, B C A, C A B, ...) so that none is
always first.  A configuration's figures are those of its median round (by time; of an even count, the faster of the
middle two); the spread over rounds is reported beside them, and report.md says so when it exceeds
:data:`NOISY_SPREAD` of the median.

A crash in a configuration is isolated by the front process (``bench_front.py``): it names the configuration and
measures the others again in a new launch.
"""

from __future__ import annotations

import statistics

# A configuration whose round times spread (max - min) by more than this share of their median gets a line in
# report.md: its figure is not to be trusted to better than that.
NOISY_SPREAD = 0.10


def schedule(configurations: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, configuration) pairs in the order they are measured: every configuration once per round, the order
    rotated by one each round."""
    count = len(configurations)
    return [(number + 1, configurations[(number + i) % count]) for number in range(rounds) for i in range(count)]


def five_numbers(values: list[float]) -> dict:
    """min, lower quartile, median, upper quartile, max (the quartiles of the values themselves, inclusive)."""
    ordered = sorted(values)
    if len(ordered) == 1:
        q1 = q3 = ordered[0]
    else:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return {"min": ordered[0], "q1": q1, "median": statistics.median(ordered), "q3": q3, "max": ordered[-1]}


def round_entry(number: int, position: int, steps: list[dict]) -> dict:
    """One round of one configuration: its measured steps' times and figures (``steps`` as bench.py records them)."""
    seconds = sum(step["step_time_s"] for step in steps)
    return {"round": number, "position": position, "seconds": seconds,
            "tokens_per_s": sum(step["real_tokens"] for step in steps) / seconds,
            "pairs_per_s": sum(step["pairs"] for step in steps) / seconds,
            "computed_tokens_per_s": sum(step["computed_tokens"] for step in steps) / seconds,
            "step_time_s": [step["step_time_s"] for step in steps], "loss": [step["loss"] for step in steps]}


def median_round(rounds: list[dict]) -> int:
    """Index of the round whose time is the median (the lower one of an even count: a round that was measured)."""
    seconds = [entry["seconds"] for entry in rounds]
    return seconds.index(statistics.median_low(seconds))


def spread(rounds: list[dict]) -> float:
    """(slowest - fastest) / median round time: 0 with one round."""
    seconds = five_numbers([entry["seconds"] for entry in rounds])
    return (seconds["max"] - seconds["min"]) / seconds["median"]
