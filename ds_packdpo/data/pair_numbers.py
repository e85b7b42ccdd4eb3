"""The per-pair numbers of a tokenized cache file (lengths, truncation flags, drop reasons, pair ids), saved beside it
by the first process that reads them and loaded by every later one without touching the Arrow file.

Reading a column of a memory-mapped Arrow file touches its pages, and the kernel maps the neighbours of each page
touched (fault-around): a warm process that read these columns from the table held ~270 bytes a pair of the file
resident (200k pairs: 52 MiB of each rank's 73 MiB growth over 10k pairs), in every rank of a node.  Saved, they are
~30 bytes a pair, read once into numpy arrays (which the plan needs in memory anyway).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..files import atomic_write

SIDES = ("prompt", "chosen", "rejected")
STAT_COLUMNS = ("prompt_cut", "completion_cut", "template_mismatches", "drop_reason")


def _read(table: pa.Table) -> dict[str, np.ndarray]:
    numbers = {f"{side}_length": pc.list_value_length(table.column(f"{side}_ids")).to_numpy(zero_copy_only=False)
               .astype(np.int64) for side in SIDES}
    numbers["pair_id"] = table.column("pair_id").to_numpy().astype(np.int64)
    for name in STAT_COLUMNS[:3]:
        numbers[name] = table.column(name).to_numpy(zero_copy_only=False)
    reasons = table.column("drop_reason")  # codes into the names: as numpy, a Python string a pair
    names = pc.unique(reasons)
    numbers["drop_names"] = np.asarray(names.to_pylist(), dtype=str)
    numbers["drop_code"] = pc.index_in(reasons, value_set=names).to_numpy(zero_copy_only=False).astype(np.int32)
    return numbers


def cached_pair_numbers(table: pa.Table, path: Path) -> dict[str, np.ndarray]:
    """``{side}_length`` (int64, ``side`` of SIDES), ``pair_id``, ``prompt_cut``, ``completion_cut``,
    ``template_mismatches`` and ``drop_code`` (an index into ``drop_names``, "" for a pair kept), one value per row of
    ``table``; from ``path`` when a process wrote it, else read from the table and written there."""
    if path.is_file():
        with np.load(path) as saved:
            return {name: saved[name] for name in saved.files}
    numbers = _read(table)

    def write(tmp):
        with open(tmp, "wb") as handle:  # a handle: np.savez would add ".npz" to the temporary name
            np.savez(handle, **numbers)

    atomic_write(path, write)
    return numbers
