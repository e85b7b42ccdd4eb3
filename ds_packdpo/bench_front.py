"""The front process of ``ds-packdpo bench``: one launch measures every configuration, a crash costs one.

All configurations are measured in one launch, in rounds (``bench_rounds.py``): that is what makes their figures
comparable (one process, one machine state, the order rotated).  A configuration that crashes its launch (a CUDA
fault, a kernel's error, a rank killed) would take the others with it, so this process watches the launch: rank 0
prints ``bench: measuring NAME (round R ...)`` before each configuration's round and every rank that fails prints
``bench: NAME failed in round R on rank K: ERROR [at FRAMES]`` before it dies (:func:`failure_line`).  When the launch
dies, the front process names the configuration it died in with its error (a rank's own error before the
collective errors of the peers it left), and, for a CUDA error, first reruns that configuration alone once with
``CUDA_LAUNCH_BLOCKING=1`` so that the error is raised at the kernel that made it (its frames are recorded).  Then it
launches the bench again without the failed configuration; the new launch's report carries the failures
(``failed`` in report.json, said first in report.md), so a bench that loses a configuration still measures the
others side by side.  Bad input (exit 2) and a stop (exit 7) end the bench as they are.

Under a launcher started by hand (``deepspeed --module ds_packdpo.bench``) there is no front process: a crash ends
the bench, whose report keeps the configurations measured so far.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InputError, PeerFailureError, StoppedError, first_line
from .report import read_report, with_failures, write_report_folder
from .run.process_group import is_collective_failure

FAILED_ENV = "DS_PACKDPO_BENCH_FAILED"  # JSON: the failures of earlier launches, for the report of this one
MEASURING = re.compile(r"bench: measuring (?P<name>\S+) \(round (?P<round>\d+) of")
FAILURE = re.compile(r"bench: (?P<name>\S+) failed in round (?P<round>\d+) on rank (?P<rank>\d+)"
                     r"(?P<peer> \(after a peer failed\))?: (?P<error>.*?)(?: \[at (?P<where>.*)\])?$")
CUDA_ERROR = re.compile(r"CUDA error|CUBLAS_STATUS|CUDNN_STATUS|cudaError|device-side assert|illegal memory access")


def measuring_line(name: str, number: int, rounds: int, position: int, count: int) -> str:
    """What rank 0 prints before a configuration's round (a log says which one died, and so does this process)."""
    return f"bench: measuring {name} (round {number} of {rounds}, configuration {position} of {count})"


def failure_line(name: str, number: int, rank: int, error: BaseException) -> str:
    """What a rank prints before it dies of ``error`` in a configuration's round: the error's first line and its
    innermost frames; a collective that failed because a peer died is marked, so that the peer's error is named."""
    peer = isinstance(error, PeerFailureError) or (isinstance(error, RuntimeError) and is_collective_failure(error))
    frames = traceback.extract_tb(error.__traceback__)[-3:]
    where = " < ".join(f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}" for frame in reversed(frames))
    return (f"bench: {name} failed in round {number} on rank {rank}{' (after a peer failed)' if peer else ''}: "
            f"{type(error).__name__}: {first_line(error)}{f' [at {where}]' if where else ''}")


@dataclass
class LaunchLog:
    """What the front process keeps of a launch's output: the configuration being measured, the failures, and
    its last lines."""

    measuring: tuple[str, int] | None = None
    failures: list[dict] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)

    def feed(self, line: str) -> None:
        line = line.rstrip("\r\n")
        if (found := MEASURING.search(line)) is not None:
            self.measuring = (found["name"], int(found["round"]))
        if (found := FAILURE.search(line)) is not None:
            self.failures.append({"name": found["name"], "round": int(found["round"]), "rank": int(found["rank"]),
                                  "peer": bool(found["peer"]), "error": found["error"], "where": found["where"]})
        self.tail = [*self.tail[-29:], line]

    def culprit(self) -> dict | None:
        """The failure that ended the launch: a rank's own error before its peers' collective errors; else (a rank
        killed, no line) the configuration being measured, with the last error-looking line."""
        own = [failure for failure in self.failures if not failure["peer"]]
        if own or self.failures:
            return (own or self.failures)[0]
        if self.measuring is None:
            return None
        errors = [line for line in self.tail if re.search(r"error|Error|killed|Killed|return code", line)]
        return {"name": self.measuring[0], "round": self.measuring[1], "rank": None, "peer": False,
                "error": errors[-1].strip() if errors else "the launch died without an error line", "where": None}


# launch(extra bench flags, extra environment, log) -> exit code of the launch
Launch = Callable[[list[str], dict, LaunchLog], int]


def run_isolated(configurations: list[str], out: str, launch: Launch) -> int:
    """The bench of ``configurations`` in one launch; a configuration that crashes it is named, rerun alone with
    ``CUDA_LAUNCH_BLOCKING=1`` after a CUDA error, and the others launched again without it.  Returns the exit code:
    the last launch's, or 1 when a configuration failed (the report names it)."""
    remaining, failed, started = list(configurations), {}, time.time()
    while remaining:
        log = LaunchLog()
        code = launch(["--configurations", ",".join(remaining), *(["--overwrite"] if failed else [])],
                      {FAILED_ENV: json.dumps(failed)}, log)
        if code == 0:
            break
        culprit = log.culprit()
        if (code in (InputError.exit_code, StoppedError.exit_code) or culprit is None
                or culprit["name"] not in remaining or measured(Path(out), culprit, started)):
            return code  # bad input, a stop, or a death no configuration explains: as it is
        failed[culprit["name"]] = failure_record(culprit, code, out, launch)
        remaining.remove(culprit["name"])
        mark_failed(Path(out), failed, started)
        left = f"measuring {', '.join(remaining)} again without it" if remaining else "no configuration left"
        print(f"bench: {culprit['name']} failed in round {culprit['round']}: {culprit['error']}; {left}",
              file=sys.stderr, flush=True)
    if not remaining:
        print(f"error: bench: every configuration failed ({', '.join(failed)}); nothing was measured",
              file=sys.stderr, flush=True)
    return 1 if failed else 0


def this_bench_report(out: Path, started: float) -> dict | None:
    """The report this bench's launches wrote into ``out`` (None: none yet, or only a folder it was to replace)."""
    path = out / "report.json"
    return read_report(out) if path.is_file() and path.stat().st_mtime >= started else None


def measured(out: Path, culprit: dict, started: float) -> bool:
    """Whether the round a launch died in, named by rank 0's last line alone (no rank said it failed), was measured
    after all: the launch died after it (in the teardown), not of it."""
    report = None if culprit["rank"] is not None else this_bench_report(out, started)
    run = (report or {}).get("runs", {}).get(culprit["name"])
    return run is not None and any(entry["round"] == culprit["round"] for entry in run["rounds"])


def mark_failed(out: Path, failed: dict, started: float) -> None:
    """Writes the failures into the report the dead launch left (if it wrote one): the folder says them even if no
    later launch measures anything."""
    report = this_bench_report(out, started)
    if report is not None:
        write_report_folder(with_failures(report, failed), out, overwrite=True)


def failure_record(culprit: dict, code: int, out: str, launch: Launch) -> dict:
    """report.json's entry of a failed configuration; after a CUDA error, with its rerun alone under
    ``CUDA_LAUNCH_BLOCKING=1`` (into a scratch folder beside --out, removed after)."""
    record = {"error": culprit["error"], "round": culprit["round"], "rank": culprit["rank"], "where": culprit["where"],
              "exit_code": code, "blocking_rerun": None}
    if not CUDA_ERROR.search(culprit["error"]):
        return record
    parent = Path(out).resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{Path(out).name}.blocking-", dir=parent))
    try:
        log = LaunchLog()
        rerun_code = launch(["--configurations", culprit["name"], "--bench-rounds", "1", "--out",
                             str(scratch / "report"), "--overwrite"], {"CUDA_LAUNCH_BLOCKING": "1"}, log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    again = log.culprit()
    if rerun_code == 0 or again is None:
        record["blocking_rerun"] = {"error": f"ran through alone (exit {rerun_code})", "where": None}
    else:
        record["blocking_rerun"] = {"error": again["error"], "where": again["where"]}
    return record
