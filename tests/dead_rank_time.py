"""Seconds from a rank's death to the end of the job, the figure of the README's reliability section.

``ds-packdpo train`` on 2 CPU ranks (the real deepspeed launcher), rank RANK SIGKILLed as optimizer step STEP
begins (``DS_PACKDPO_FAULT_KILL``, which prints its time stamp first); the job's end is when the front command
returns.  Prints one line per repeat: the exit code and the seconds from the kill to the end.

    python tests/dead_rank_time.py [--rank 1] [--step 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time

from launching import REPO, SMALL_RUN, cpu_env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--step", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as folder:
            cmd = [sys.executable, "-m", "ds_packdpo.cli", "train", "--num-procs", "2", *SMALL_RUN,
                   "--max-steps", str(args.step + 3), "--output-dir", f"{folder}/run", "--cache-dir", f"{folder}/cache"]
            proc = subprocess.run(cmd, cwd=REPO, env=cpu_env(DS_PACKDPO_FAULT_KILL=f"{args.rank}:{args.step}"),
                                  capture_output=True, text=True)
            ended = time.time()
        killed = re.search(r"fault: pid \d+ SIGKILLs itself at ([0-9.]+)", proc.stderr)
        if killed is None:
            print(f"exit {proc.returncode}: no kill happened\n{proc.stderr[-2000:]}")
            return 1
        last = proc.stderr.strip().splitlines()[-1]
        print(f"exit {proc.returncode}, {ended - float(killed.group(1)):.1f} s from the kill of rank {args.rank} "
              f"(step {args.step}) to the end of the job: {last}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
