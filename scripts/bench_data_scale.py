"""Host memory and time of the data path at scale: prepare, a warm dry run, and the ranks of a real run, 10k vs 1M.

Usage: ``python scripts/bench_data_scale.py --work DIR [--pairs 1000000] [--small-pairs 10000] [--keep-cache]``.  Writes
``DIR/pairs-N.jsonl`` (scripts/synthetic_pairs.py's generator, seed 0) and the data's tokenizer once, then measures,
each in its own commands:

1. ``ds-packdpo prepare`` of the large file with a cold cache: wall time and peak RSS;
2. ``ds-packdpo train --dry-run`` of it with the cache warm: the peak RSS of its one process;
3. a real 2-step run on 2 ranks (a tiny model) of the small and of the large file, caches warm: the peak of each
   rank, of the front process and of the launcher processes.

Each process's peak is the kernel's high-water mark (``VmHWM`` of /proc/PID/status: resident pages, the memory-mapped
cache's touched pages included), read every 0.1 s until it exits, with the largest anonymous resident size seen
(``RssAnon``: what no other process shares and the kernel cannot drop).  Memory figures do not move with the machine's
load; the wall times do.  Prints one JSON object (also ``DIR/data_scale.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def _status(pid: int) -> dict[str, int]:
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "RssAnon"):
                fields[key] = int(value.split()[0]) // 1024  # kB -> MiB
    except OSError:
        pass
    return fields


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _role(pid: int, root: int) -> str:
    if pid == root:
        return "front"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "launcher"
    rank = next((arg.split(b"=")[1].decode() for arg in argv if arg.startswith(b"--local_rank=")), None)
    return f"rank {rank}" if rank is not None else "launcher"


def measured(cmd: list[str]) -> dict:
    """Runs ``cmd``; its wall time and every process's peaks, by role (front, launcher, rank N)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, dict] = {}
    while proc.poll() is None:
        for pid in _descendants(proc.pid):
            status = _status(pid)
            if status:
                seen = peaks.setdefault(pid, {"role": _role(pid, proc.pid), "VmHWM": 0, "RssAnon": 0})
                seen["VmHWM"] = max(seen["VmHWM"], status.get("VmHWM", 0))
                seen["RssAnon"] = max(seen["RssAnon"], status.get("RssAnon", 0))
        time.sleep(0.1)
    output = proc.stdout.read()
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"exit {proc.returncode}: {' '.join(cmd)}\n{output[-3000:]}")
    by_role: dict[str, dict] = {}
    for seen in peaks.values():
        role = by_role.setdefault(seen["role"], {"peak_rss_mib": 0, "peak_anon_mib": 0})
        role["peak_rss_mib"] = max(role["peak_rss_mib"], seen["VmHWM"])
        role["peak_anon_mib"] = max(role["peak_anon_mib"], seen["RssAnon"])
    result = {"command": " ".join(map(str, cmd)), "wall_s": round(wall, 1), "processes": dict(sorted(by_role.items()))}
    print(json.dumps(result), file=sys.stderr, flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--pairs", type=int, default=1_000_000)
    parser.add_argument("--small-pairs", type=int, default=10_000)
    parser.add_argument("--keep-cache", action="store_true",
                        help="measure prepare with the tokenized cache DIR/cache already holds (warm), not cold")
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    from ds_packdpo.data.synthetic import default_tokenizer, synthetic_preference_rows, write_synthetic_pairs

    tokenizer = work / "tokenizer"
    if not tokenizer.is_dir():
        default_tokenizer(synthetic_preference_rows(2048, seed=0)).save_pretrained(tokenizer)
    files = {}
    for n in (args.small_pairs, args.pairs):
        files[n] = work / f"pairs-{n}.jsonl"
        if not files[n].is_file():
            write_synthetic_pairs(files[n], n, seed=0)
    cache = work / "cache"
    cli = str(BIN / "ds-packdpo")
    data = ["--tokenizer", str(tokenizer), "--cache-dir", str(cache), "--no-progress"]
    results = {"pairs": args.pairs, "small_pairs": args.small_pairs, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                          time.gmtime())}
    for path in [] if args.keep_cache else cache.glob("*"):  # the large file's prepare starts cold
        if path.is_file():
            path.unlink()
    results["prepare_cache"] = "warm" if args.keep_cache else "cold"
    results["prepare"] = measured([cli, "prepare", "--dataset", str(files[args.pairs]), *data,
                                   "--out", str(work / "prepared.jsonl"), "--overwrite"])
    run = ["--model-config", "tiny", *data, "--global-batch-pairs", "16", "--max-steps", "2", "--dtype", "fp32"]
    results["dry_run"] = measured([cli, "train", "--dry-run", "--dataset", str(files[args.pairs]), *run])
    measured([cli, "prepare", "--dataset", str(files[args.small_pairs]), *data, "--out", str(work / "small.jsonl"),
              "--overwrite"])  # warm the small file's cache too
    for name, n in (("run_small", args.small_pairs), ("run_large", args.pairs)):
        results[name] = measured([cli, "train", "--num-procs", "2", "--dataset", str(files[n]), *run,
                                  "--output-dir", str(work / name), "--overwrite"])
    ranks = [role for role in results["run_large"]["processes"] if role.startswith("rank")]
    results["rank_growth_mib"] = {
        key: max(results["run_large"]["processes"][r][key] - results["run_small"]["processes"][r][key] for r in ranks)
        for key in ("peak_rss_mib", "peak_anon_mib")}
    text = json.dumps(results, indent=2)
    (work / "data_scale.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
