"""The bench's rounds, its comparisons table, the front process that isolates a configuration that crashes, the CPU
allocator held in one state; and one real front-process bench on multi-response data whose configuration crashes
(three 2-rank launches: the crash, its rerun alone under CUDA_LAUNCH_BLOCKING=1, the others again)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_packdpo import bench, comparisons
from ds_packdpo.bench_front import FAILED_ENV, LaunchLog, run_isolated
from ds_packdpo.bench_rounds import NOISY_SPREAD, five_numbers, schedule
from ds_packdpo.comparisons import COMPARISONS, GROUPS_OFF, LEGACY_KEYS, Comparison, headline, short_headline
from ds_packdpo.errors import InputError
from ds_packdpo.model.build import tiny_config
from ds_packdpo.report import (REPORT_SCHEMA, check_report, merge_reports, merged_markdown, read_report,
                               render_markdown, write_report_folder)
from ds_packdpo.report_plots import tokens_per_s_figure
from ds_packdpo.run.cpu_memory import reset_resident_peak, resident_peak_bytes

from launching import REPO, cpu_env, ranks_script, run

DOCS = REPO / "docs"
MULTI_DEMO_PATH = REPO.parent / "shared" / "data" / "multi_response_demo.jsonl"


# ---- rounds ------------------------------------------------------------------------------------

def test_rounds_rotate_the_order_so_that_no_configuration_is_always_first():
    order = schedule(["a", "b", "c"], 4)
    assert order == [(1, "a"), (1, "b"), (1, "c"), (2, "b"), (2, "c"), (2, "a"), (3, "c"), (3, "a"), (3, "b"),
                     (4, "a"), (4, "b"), (4, "c")]
    assert schedule(["packed", "padded"], 2) == [(1, "packed"), (1, "padded"), (2, "padded"), (2, "packed")]
    assert five_numbers([4.0, 1.0, 3.0, 2.0, 5.0]) == {"min": 1.0, "q1": 2.0, "median": 3.0, "q3": 4.0, "max": 5.0}
    assert five_numbers([2.0]) == dict.fromkeys(("min", "q1", "median", "q3", "max"), 2.0)


def two_round_report(padded_seconds: tuple[float, float]) -> dict:
    """A schema-3 report (docs/bench_prefix_report.json: packed and packed-no-prefix-sharing, one round each) with a
    padded run of two rounds taking ``padded_seconds``, and packed's two rounds 1.0 s each."""
    report = check_report(json.loads((DOCS / "bench_prefix_report.json").read_text()), "old")
    packed = report["runs"]["packed"]
    steps = packed["steps"]
    tokens, pairs = sum(s["real_tokens"] for s in steps), sum(s["pairs"] for s in steps)

    def round_(number, seconds, computed):
        return {"round": number, "position": number, "seconds": seconds, "tokens_per_s": tokens / seconds,
                "pairs_per_s": pairs / seconds, "computed_tokens_per_s": computed / seconds,
                "step_time_s": [seconds], "loss": [0.69]}

    packed["rounds"] = [round_(1, 1.0, packed["computed_tokens"]), round_(2, 1.0, packed["computed_tokens"])]
    packed.update(tokens_per_s=tokens, pairs_per_s=pairs, computed_tokens_per_s=packed["computed_tokens"])
    padded = dict(packed, name="padded", computed_tokens=2 * packed["computed_tokens"], packing=False)
    padded["rounds"] = [round_(number, seconds, padded["computed_tokens"])
                        for number, seconds in enumerate(padded_seconds, start=1)]
    fastest = min(padded_seconds)
    seconds = five_numbers(list(padded_seconds))
    padded.update(tokens_per_s=tokens / fastest, pairs_per_s=pairs / fastest,
                  computed_tokens_per_s=padded["computed_tokens"] / fastest, round_seconds=seconds,
                  spread=(seconds["max"] - seconds["min"]) / seconds["median"])
    report["runs"]["padded"] = padded
    report.update(comparisons.report_keys(report["runs"]), comparisons=comparisons.comparisons(report["runs"]))
    return report


def test_report_says_when_a_configurations_rounds_spread_beyond_the_stated_share():
    """Every figure carries the spread of its rounds; a configuration whose rounds differ by more than NOISY_SPREAD
    of their median gets a bold line, one that does not gets none; a comparison gives the range of its speed-up
    over the rounds both configurations ran (each round's ratio, measured side by side)."""
    quiet, noisy = two_round_report((2.0, 2.1)), two_round_report((2.0, 3.0))
    assert quiet["runs"]["padded"]["spread"] < NOISY_SPREAD < noisy["runs"]["padded"]["spread"]
    assert "**Noisy:" not in render_markdown(quiet)
    assert ("**Noisy: `padded` took 2-3 s per round over 2 rounds, a spread of 40% of its median (2.5 s), more than "
            "10%" in render_markdown(noisy))
    packing = next(entry for entry in noisy["comparisons"] if entry["name"] == "packing")
    assert (packing["rounds"], packing["round_speedup_min"], packing["round_speedup_max"]) == (2, 2.0, 3.0)
    assert packing["speedup"] == pytest.approx(2.0) and packing["ideal_speedup"] == pytest.approx(2.0)
    assert "**packing (packed / padded tokens/s): 2x** (2-3 over 2 rounds), token ideal 2x (1 of it)" in \
        render_markdown(noisy)


# ---- the comparisons table ----------------------------------------------------------------------

def test_every_comparison_is_a_row_and_every_statement_of_one_comes_from_the_table(tmp_path, monkeypatch):
    """The speed-ups were computed three ways and their consumers drifted (the plot's subtitle gave two, the merged
    report one, the bench's printout seven hard-coded keys).  Each is now a row of comparisons.COMPARISONS: the
    schema-6 keys are its rows' keys, and a new row appears, with its token ideal, in report.json, report.md, the
    plot's subtitle and the merged report without another line of code."""
    assert all(row.numerator in bench.CONFIGURATIONS and row.denominator in bench.CONFIGURATIONS for row in COMPARISONS)
    assert set(LEGACY_KEYS) < {key for row in COMPARISONS for key in row.keys} <= set(REPORT_SCHEMA)
    assert len({row.name for row in COMPARISONS}) == len(COMPARISONS)
    extra = Comparison("sharing against padding", "packed", "padded", "pairs_per_s", None, "both at once")
    monkeypatch.setattr(comparisons, "COMPARISONS", (*COMPARISONS, extra))
    report = two_round_report((2.0, 2.1))
    rows = {entry["name"]: entry for entry in report["comparisons"]}
    assert list(rows) == ["packing", "prefix sharing", "sharing against padding"]
    assert rows["sharing against padding"]["speedup"] == pytest.approx(report["runs"]["packed"]["pairs_per_s"]
                                                                       / report["runs"]["padded"]["pairs_per_s"])
    markdown = render_markdown(report)
    title = tokens_per_s_figure(report).axes[0].get_title().replace("\n", " ")
    for entry in rows.values():
        assert f"- {headline(entry, bold=True)}\n" in markdown and short_headline(entry) in title
        assert f"token ideal {entry['ideal_speedup']:.3g}x" in markdown
    folder = tmp_path / "b"
    write_report_folder(report, folder)
    merged = merge_reports([str(folder)])
    assert [entry["name"] for entry in merged["comparisons"]] == list(rows)
    assert f"| {folder} | {report['world_size']} | sharing against padding | packed | padded |" in merged_markdown(merged)


def test_reports_before_rounds_read_as_one_round_with_their_speedups_from_the_table():
    """A schema-3 folder: one round per configuration, in the order of its runs, the speed-ups it held recomputed
    by the table (the same figures) and the ones it lacked added."""
    old = json.loads((DOCS / "bench_prefix_report.json").read_text())
    report = check_report(json.loads(json.dumps(old)), "old")
    assert report["rounds"] == 1 and report["order"] == [[1, name] for name in old["runs"]] and report["failed"] == {}
    for name, run in report["runs"].items():
        assert run["rounds"][0]["tokens_per_s"] == pytest.approx(old["runs"][name]["tokens_per_s"])
        assert run["median_round"] == 1 and run["spread"] == 0
    assert report["prefix_sharing_speedup"] == pytest.approx(old["prefix_sharing_speedup"])
    assert report["prefix_sharing_speedup_over_ideal"] == pytest.approx(old["prefix_sharing_speedup"]
                                                                        / old["prefix_sharing_ideal_speedup"])
    assert [entry["name"] for entry in report["comparisons"]] == ["prefix sharing"]
    broken = json.loads(json.dumps(old))
    broken["runs"]["packed"]["steps"] = []
    with pytest.raises(InputError, match="runs.packed.steps is not a list of measured steps"):
        check_report(broken, "old")


# ---- the front process ----------------------------------------------------------------------------

class FakeLaunches:
    """Launches that print what ranks would: each call takes the next scripted (exit code, lines)."""

    def __init__(self, *outcomes):
        self.outcomes, self.calls = list(outcomes), []

    def __call__(self, extra, env, log):
        self.calls.append((list(extra), dict(env)))
        code, lines, *during = self.outcomes.pop(0)
        for work in during:  # what the launch writes (its report)
            work()
        for line in lines:
            log.feed(line)
        return code


def crash(name: str, error: str, rank: int = 1, peer_first: bool = True) -> list[str]:
    lines = [f"bench: measuring {name} (round 1 of 2, configuration 2 of 3)"]
    if peer_first:
        lines.append(f"bench: {name} failed in round 1 on rank 0 (after a peer failed): RuntimeError: Connection "
                     f"closed by peer [at distributed_c10d.py:10 in all_gather]")
    return [*lines, f"bench: {name} failed in round 1 on rank {rank}: {error} [at kernel.py:7 in attend]"]


def test_the_front_process_names_a_crashed_configuration_and_measures_the_others_again(tmp_path, capsys):
    """A rank's own error is named before the collective errors of the peers it left; a CUDA error is rerun alone
    once with CUDA_LAUNCH_BLOCKING=1 (its frames recorded); the next launch leaves the configuration out and carries
    the failure to the report; a non-CUDA error is not rerun."""
    out = str(tmp_path / "b")
    cuda = "RuntimeError: CUDA error: an illegal memory access was encountered"
    launches = FakeLaunches((1, crash("padded", cuda)), (1, crash("padded", cuda + " in attend_kernel")),
                            (1, crash("lora", "ValueError: bad shape", peer_first=False)), (0, []))
    assert run_isolated(["packed", "padded", "lora"], out, launches) == 1
    first, rerun, second, last = launches.calls
    assert first == (["--configurations", "packed,padded,lora"], {FAILED_ENV: "{}"})
    assert rerun[0][:4] == ["--configurations", "padded", "--bench-rounds", "1"] and rerun[1] == {
        "CUDA_LAUNCH_BLOCKING": "1"}
    assert second[0] == ["--configurations", "packed,lora", "--overwrite"]
    failed = json.loads(last[1][FAILED_ENV])
    assert last[0] == ["--configurations", "packed", "--overwrite"] and list(failed) == ["padded", "lora"]
    assert failed["padded"] == {"error": cuda, "round": 1, "rank": 1, "where": "kernel.py:7 in attend", "exit_code": 1,
                                "blocking_rerun": {"error": cuda + " in attend_kernel", "where": "kernel.py:7 in attend"}}
    assert failed["lora"]["blocking_rerun"] is None and failed["lora"]["error"] == "ValueError: bad shape"
    assert f"bench: padded failed in round 1: {cuda}; measuring packed, lora again without it" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # the rerun's scratch folder is gone


def test_the_front_process_leaves_bad_input_stops_and_unexplained_deaths_as_they_are(tmp_path, capsys):
    """Exit 2 (bad input) and 7 (a stop) are not crashes of a configuration; a death before any configuration
    started names none, and so does one after the last round its report holds (in the teardown); a rank killed
    without a line (out of memory) is named by the configuration being measured and the launcher's line; when every
    configuration fails, the bench says so and exits 1."""
    report = check_report(json.loads((DOCS / "bench_prefix_report.json").read_text()), "old")
    out = tmp_path / "b"
    launches = FakeLaunches((1, ["bench: measuring packed (round 1 of 1, configuration 2 of 2)"],
                             lambda: write_report_folder(report, out)))
    assert run_isolated(list(report["runs"]), str(out), launches) == 1 and len(launches.calls) == 1
    for code in (InputError.exit_code, 7):
        launches = FakeLaunches((code, crash("padded", "RuntimeError: x")))
        assert run_isolated(["packed", "padded"], "unused", launches) == code and len(launches.calls) == 1
    launches = FakeLaunches((1, ["error: the process group did not start"]))
    assert run_isolated(["packed"], "unused", launches) == 1 and len(launches.calls) == 1
    killed = ["bench: measuring padded (round 2 of 3, configuration 1 of 2)",
              "[launch.py:319:sigkill_handler] Killing subprocess 1234", "Process 1234 exits with return code = -9"]
    launches = FakeLaunches((5, killed), (0, []))
    assert run_isolated(["packed", "padded"], "unused", launches) == 1
    failed = json.loads(launches.calls[1][1][FAILED_ENV])
    assert failed["padded"]["error"] == "Process 1234 exits with return code = -9" and failed["padded"]["round"] == 2
    launches = FakeLaunches((1, crash("packed", "RuntimeError: boom")))
    assert run_isolated(["packed"], "unused", launches) == 1
    assert "error: bench: every configuration failed (packed); nothing was measured" in capsys.readouterr().err
    log = LaunchLog()
    log.feed("bench: x failed in round 3 on rank 2: KeyError: 'a b' [at a.py:1 in f < b.py:2 in g]\n")
    assert log.culprit() == {"name": "x", "round": 3, "rank": 2, "peer": False, "error": "KeyError: 'a b'",
                             "where": "a.py:1 in f < b.py:2 in g"}


# ---- the CPU allocator and the peak memory -------------------------------------------------------

FAULTS_PER_STEP = """
import ctypes, resource, sys
from ds_packdpo.run.cpu_memory import steady_allocator
if sys.argv[1] == "steady":
    assert steady_allocator()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
faults = []
for _ in range(4):  # a step: ten 3 MiB blocks written and freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(3 << 20) for _ in range(10)]
    for block in blocks:
        ctypes.memset(block, 1, 3 << 20)
    for block in blocks:
        libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults)
"""


def test_the_steady_allocator_serves_every_step_from_memory_it_kept():
    """Left to itself glibc hands a step's freed blocks back to the kernel and faults them in again at the next step
    (its trim threshold follows the blocks it has seen); fixed by steady_allocator, only the first step faults.
    Page faults are counts, which the machine's load does not move."""
    counts = {}
    for mode in ("default", "steady"):
        result = subprocess.run([sys.executable, "-c", FAULTS_PER_STEP, mode], cwd=REPO, capture_output=True,
                                text=True, check=True, env=cpu_env())
        counts[mode] = json.loads(result.stdout)
    pages = 10 * (3 << 20) // 4096
    assert all(count > 0.9 * pages for count in counts["default"])  # every step faults its 30 MiB in again
    assert counts["steady"][0] > 0.9 * pages and max(counts["steady"][1:]) < 0.01 * pages


def test_peak_memory_is_the_kernels_resident_peak_since_the_reset():
    """The bench's CPU peak memory: the kernel's high-water mark, reset as a configuration's round starts (a thread
    sampled the RSS every 10 ms before, on a core the ranks needed)."""
    ballast = b"\x01" * (200 << 20)
    del ballast
    peak_before = resident_peak_bytes()
    assert reset_resident_peak()
    reset = resident_peak_bytes()
    assert reset <= peak_before - (150 << 20)  # the 200 MiB block freed is no longer the peak
    block = b"\x01" * (64 << 20)
    assert resident_peak_bytes() >= reset + (60 << 20)
    del block


# ---- default configurations -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory, demo_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    demo_tokenizer.save_pretrained(folder)
    return folder


def multi_response_flags(tmp_path: Path, tokenizer_folder: Path, *flags: str) -> list[str]:
    """The first 96 pairs (23 prompts with --pairs-from all, at most 7 pairs each), 4 pairs or more per step."""
    return ["--dataset", str(MULTI_DEMO_PATH), "--tokenizer", str(tokenizer_folder), "--max-length", "1024",
            "--max-pairs", "96", "--global-batch-pairs", "4", "--cache-dir", str(tmp_path / "cache"), "--no-progress",
            *flags]


@pytest.mark.skipif(not MULTI_DEMO_PATH.exists(), reason="needs ../shared/data/multi_response_demo.jsonl")
def test_default_configurations_measure_prompt_groups_where_prompts_repeat(tmp_path, tokenizer_folder):
    """prompt_groups_speedup was null on multi-response data unless --configurations named packed-no-prompt-groups:
    the README's headline could not be reproduced with the defaults.  It is a default where prompt groups save at
    least PROMPT_GROUPS_WORTH of the tokens (every pair of 4 answers per prompt: --pairs-from all), and not where
    each prompt has one pair (--pairs-from best-vs-worst), nor with --configurations."""
    def configurations(*flags: str) -> list[str]:
        args = multi_response_flags(tmp_path, tokenizer_folder, "--out", str(tmp_path / "b"), "--max-steps", "1",
                                    "--bench-warmup-steps", "0", *flags)
        return list(bench.check_configurations(*bench.parse_bench_args(args), world_size=1).setups)

    assert configurations("--pairs-from", "all") == ["packed", "packed-no-prefix-sharing", GROUPS_OFF, "padded"]
    assert configurations() == ["packed", "packed-no-prefix-sharing", "padded"]
    assert configurations("--pairs-from", "all", "--configurations", "packed,padded") == ["packed", "padded"]


# ---- one real bench through the front process ----------------------------------------------------

@pytest.mark.multirank
@pytest.mark.skipif(not MULTI_DEMO_PATH.exists(), reason="needs ../shared/data/multi_response_demo.jsonl")
def test_a_crashed_configuration_costs_itself_alone(tmp_path, tokenizer_folder, capfd):
    """Done-when of issues 41 and 38 on CPU: `bench` with default configurations on multi_response_demo.jsonl
    (every pair of 4 answers) reports prompt_groups_speedup and its ideal, in rounds (the order rotated, every round
    the same losses); a configuration whose rank 1 raises a CUDA error (a test-only hook, tests/bench_fault_rank.py)
    is named with its error and round, rerun alone with CUDA_LAUNCH_BLOCKING=1 (the kernel named), and the others
    are measured again in one launch without it."""
    model = tmp_path / "tiny.json"
    tiny_config(vocab_size=4096).to_json_file(str(model))
    out = tmp_path / "bench"
    flags = multi_response_flags(tmp_path, tokenizer_folder, "--pairs-from", "all", "--model-config", str(model),
                                 "--max-steps", "1", "--bench-warmup-steps", "0", "--bench-rounds", "2", "--out",
                                 str(out))
    configurations = list(bench.check_configurations(*bench.parse_bench_args(flags), world_size=2).setups)
    assert configurations == ["packed", "packed-no-prefix-sharing", GROUPS_OFF, "padded"]
    outputs = []

    def launch(extra, env, log):
        started = time.monotonic()
        proc = run(ranks_script(2, "tests/bench_fault_rank.py", *flags, *extra), check=False,
                   env=cpu_env(OMP_NUM_THREADS="1", BENCH_FAULT="packed-no-prefix-sharing:1:1", **env))
        for line in (proc.stdout + proc.stderr).splitlines():
            log.feed(line)
        outputs.append(proc.stdout)
        print(f"launch {extra}: {time.monotonic() - started:.1f} s")
        return proc.returncode

    assert run_isolated(configurations, str(out), launch) == 1
    assert len(outputs) == 3 and not list(tmp_path.glob(".bench.blocking-*"))
    report = read_report(out)
    failure = report["failed"]["packed-no-prefix-sharing"]
    assert (failure["round"], failure["rank"]) == (1, 1)
    assert failure["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert failure["blocking_rerun"]["error"] == failure["error"] + " in fused_attention_kernel"
    assert failure["blocking_rerun"]["where"].startswith("bench_fault_rank.py:")
    runs = report["runs"]
    assert list(runs) == ["packed", GROUPS_OFF, "padded"] and report["unmeasured"] == []
    # the others, in rounds: every configuration once per round, the order rotated, each round the same work
    assert report["rounds"] == 2 and report["order"] == [[1, "packed"], [1, GROUPS_OFF], [1, "padded"],
                                                         [2, GROUPS_OFF], [2, "padded"], [2, "packed"]]
    for name, run_ in runs.items():
        assert [entry["round"] for entry in run_["rounds"]] == [1, 2]
        assert [entry["position"] for entry in run_["rounds"]] == {"packed": [1, 3], GROUPS_OFF: [2, 1],
                                                                   "padded": [3, 2]}[name]
        first, second = run_["rounds"]
        assert first["loss"] == second["loss"]  # rebuilt identically: the same losses to the last bit
        median = run_["rounds"][run_["median_round"] - 1]
        assert run_["tokens_per_s"] == pytest.approx(run_["real_tokens"] / median["seconds"])
        assert [s["step_time_s"] for s in run_["steps"]] == median["step_time_s"]
        seconds = sorted(entry["seconds"] for entry in run_["rounds"])
        assert run_["spread"] == pytest.approx((seconds[1] - seconds[0]) / run_["round_seconds"]["median"])
    assert report["same_trajectory"] is True
    groups = next(entry for entry in report["comparisons"] if entry["name"] == "prompt groups")
    assert report["prompt_groups_speedup"] == groups["speedup"] == pytest.approx(runs["packed"]["pairs_per_s"]
                                                                                 / runs[GROUPS_OFF]["pairs_per_s"])
    ideal = runs[GROUPS_OFF]["computed_tokens"] / runs["packed"]["computed_tokens"]
    assert report["prompt_groups_ideal_speedup"] == pytest.approx(ideal) and ideal > 1.5
    assert groups["rounds"] == 2 and groups["round_speedup_min"] <= groups["round_speedup_max"]
    markdown = (out / "report.md").read_text()
    opening = markdown.split("\n\n")
    assert opening[1].startswith("**Failed: `packed-no-prefix-sharing` (round 1, rank 1): RuntimeError: CUDA error: "
                                 "an illegal memory access was encountered; alone with CUDA_LAUNCH_BLOCKING=1: ")
    assert opening[2].startswith("Speed-ups measured")
    assert f"- {headline(groups, bold=True)}" in markdown and report["prefix_sharing_speedup"] is None
    assert f"bench: {headline(groups)}" in outputs[-1]  # the printout: the same lines
