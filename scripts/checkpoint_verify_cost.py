"""What a checkpoint's manifest costs: writing it at save, and verifying it (page cache warm, then cold).

``python scripts/checkpoint_verify_cost.py SRC_TAG OUT_DIR [--gb 3]``: copies a checkpoint folder (any run's
``global_stepN``) to ``OUT_DIR/global_stepN`` with its optimizer shard replaced by one of ``--gb`` GB, then times
``write_manifest`` (what a save adds) and the check a resume runs (``tag_problem``: sizes, checksums, pickle scan),
once with the file in the page cache and once after dropping its pages (``posix_fadvise(DONTNEED)``, no root needed).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import time
from pathlib import Path

import torch

from ds_packdpo.run.checkpoint import tag_problem
from ds_packdpo.run.manifest import MANIFEST_FILE, write_manifest


def drop_cache(tag: Path) -> None:
    for path in tag.rglob("*"):
        if path.is_file():
            handle = os.open(path, os.O_RDONLY)
            os.posix_fadvise(handle, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src_tag")
    parser.add_argument("out_dir")
    parser.add_argument("--gb", type=float, default=3.0)
    args = parser.parse_args()
    src = Path(args.src_tag)
    tag = Path(args.out_dir) / src.name
    shutil.rmtree(tag, ignore_errors=True)
    shutil.copytree(src, tag)
    (tag / MANIFEST_FILE).unlink(missing_ok=True)
    [shard] = tag.glob("*optim_states.pt")
    torch.save({"fp32_flat_groups": [torch.ones(int(args.gb * 1e9 / 4))]}, shard)
    os.sync()
    started = time.perf_counter()
    manifest = write_manifest(tag)
    size = sum(entry["size"] for entry in manifest["files"].values())
    print(f"write_manifest: {size:,} bytes in {time.perf_counter() - started:.2f} s (page cache warm)")
    for cache in ("warm", "cold"):
        if cache == "cold":
            drop_cache(tag)
        started = time.perf_counter()
        _, problem = tag_problem(tag)
        assert problem is None, problem
        print(f"verify ({cache}): {time.perf_counter() - started:.2f} s")
    data = bytes(1 << 30)
    started = time.perf_counter()
    hashlib.blake2b(data, digest_size=16)
    print(f"blake2b of 1 GiB in memory on this machine now: {(1 << 30) / 1e9 / (time.perf_counter() - started):.2f} "
          f"GB/s")


if __name__ == "__main__":
    main()
