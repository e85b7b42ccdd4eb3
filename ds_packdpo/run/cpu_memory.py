"""A CPU rank's memory: glibc's allocator held in one state, and the peak resident set read from the kernel.

On CPU every tensor is a glibc ``malloc``.  Left alone, glibc adapts its mmap threshold (blocks above it are mapped
afresh, and their pages faulted in and zeroed, at every allocation) and its trim threshold (free memory above it is
given back to the kernel, to be faulted in again) to the largest blocks it has seen freed so far: how a step's
memory is served then depends on what the process ran before.  Measured on 2 CPU ranks (dpo_en_demo, 8,192-token
rows, the bench model): the packed configuration measured first took a median 17,800 page faults per measured step
and rank (up to 74,000), the same configuration measured after the padded one 5 (up to 17,700); with the thresholds
fixed at start-up, 14 and 5, and the padded configuration half its faults.  :func:`steady_allocator` fixes them (the largest
mmap threshold glibc takes; memory freed stays with the process, as CUDA's caching allocator keeps it) and
:func:`release_free_memory` gives the free memory back between a bench's configurations, so that each starts from
the same state.  Nothing is done off glibc (another libc, or an allocator preloaded by the user).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
from pathlib import Path

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit); above it a block is mapped
TRIM_THRESHOLD = 2**31 - 1  # an int: free memory up to 2 GiB at the top of the heap stays mapped
STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def _glibc():
    """glibc when this process runs on it (mallopt and malloc_trim are glibc's), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 -- only glibc has it
    except (OSError, AttributeError):
        return None
    return libc


def steady_allocator() -> bool:
    """Fixes glibc's mmap and trim thresholds (which also stops their adaptation); True when it did."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                     TRIM_THRESHOLD))


def release_free_memory() -> None:
    """Gives the memory the process has freed back to the kernel (``malloc_trim(0)``)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def resident_peak_bytes() -> int:
    """The process's peak resident set since its last :func:`reset_resident_peak` (VmHWM)."""
    match = re.search(r"^VmHWM:\s+(\d+) kB", STATUS.read_text(), re.MULTILINE)
    return int(match.group(1)) * 1024


def reset_resident_peak() -> bool:
    """Sets the kernel's peak resident set of this process to its current one (Linux >= 4.0); True when it did."""
    try:
        CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False
