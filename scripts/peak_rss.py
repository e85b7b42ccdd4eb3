"""Runs a command and prints the peak resident memory of its largest process.

Under the deepspeed launcher that is the largest rank: the launcher waits for its
ranks, so their peaks reach this process's RUSAGE_CHILDREN (ru_maxrss is a maximum,
not a sum).  Usage: ``python scripts/peak_rss.py deepspeed --num_gpus 2 --module ...``
"""

from __future__ import annotations

import resource
import subprocess
import sys


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    returncode = subprocess.call(sys.argv[1:])
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
    print(f"peak RSS of the largest process: {peak_kib / 1024:.0f} MiB", file=sys.stderr)
    return returncode


if __name__ == "__main__":
    sys.exit(main())
