"""The parallel layout of a run: which ranks share a row, which hold replicas, what DeepSpeed divides by.

Made once from the launch (the launcher's environment, before any process group) and
read by everything that needs a size or a rank: the plan (one share per data-parallel
rank), the loss normalization, the checkpoint and its resume check, the metrics and the
report.  Nothing else recomputes these numbers, and every name says which size it means.

Consecutive ranks form a sequence-parallel group of ``sp_size`` ranks that split one row
between them; the ``dp_size = world_size / sp_size`` groups are data-parallel replicas.
Pure Python (no torch): ``pack-stats`` plans with it too.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from ..errors import InputError

# Where launchers announce the world size and this process's rank before any process group exists:
# deepspeed/torchrun, Open MPI's mpirun, MPICH/Intel MPI (PMI).
WORLD_SIZE_ENV = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
RANK_ENV = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def _launch_value(keys: tuple[str, ...], default: int) -> int:
    for key in keys:
        if os.environ.get(key):
            return int(os.environ[key])
    return default


def launch_world_size() -> int:
    """World size as the launcher announced it (1 outside a launcher)."""
    return _launch_value(WORLD_SIZE_ENV, 1)


def launched() -> bool:
    """True under a launcher (deepspeed, torchrun, mpirun): it announced a world size; False for a lone process."""
    return any(os.environ.get(key) for key in WORLD_SIZE_ENV)


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it), so two runs on one machine never collide."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def describe_sizes(sizes: dict) -> str:
    """A layout's sizes (``ParallelLayout.as_dict()``, as checkpoints and reports store them) in words."""
    ranks = "1 rank" if sizes["world_size"] == 1 else f"{sizes['world_size']} ranks"
    return f"{ranks} ({sizes['dp_size']} data-parallel x {sizes['sp_size']} sequence-parallel)"


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int  # every rank of the job
    sp_size: int = 1  # ranks that share one row (DeepSpeed-Ulysses sequence parallelism)
    rank: int = 0  # this process's global rank
    zero_stage: int = 3

    def __post_init__(self):
        if self.sp_size < 1:
            raise InputError(f"--sequence-parallel-size must be >= 1, got {self.sp_size}")
        if self.world_size < 1:
            raise InputError(f"the world size must be >= 1, got {self.world_size}")
        if self.world_size % self.sp_size != 0:
            raise InputError(f"--sequence-parallel-size {self.sp_size} does not divide the world size "
                             f"{self.world_size} (launch a multiple of {self.sp_size} ranks)")
        if not 0 <= self.rank < self.world_size:
            raise InputError(f"rank {self.rank} is outside a world of {self.world_size} ranks")

    @classmethod
    def from_launch(cls, sp_size: int, zero_stage: int, world_size: int | None = None) -> ParallelLayout:
        """This process's layout from the launcher's environment (``world_size`` overrides it before a launch)."""
        rank = _launch_value(RANK_ENV, 0) if world_size is None else 0
        return cls(world_size or launch_world_size(), sp_size, rank, zero_stage)

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: the plan deals every step over this many shares."""
        return self.world_size // self.sp_size

    @property
    def dp_rank(self) -> int:
        """This rank's share of the plan: the ranks of one sequence-parallel group run the same rows."""
        return self.rank // self.sp_size

    @property
    def sp_rank(self) -> int:
        """This rank's place within its sequence-parallel group (which slice of every row it holds)."""
        return self.rank % self.sp_size

    @property
    def gradient_divisor(self) -> int:
        """The count DeepSpeed divides the rank-summed gradients by.

        Stages 0-2 divide by the data-parallel size.  ZeRO-3's reduce-scatter
        (``reduce_scatter_coalesced``, its default path) divides by the whole world,
        ignoring the sequence-parallel size (deepspeed 0.19.8: read in stage3.py, and
        seen here as a grad norm S times too small).  The loss is scaled by this count
        so that the reduced gradient is the step's mean over pairs either way.
        """
        return self.world_size if self.zero_stage == 3 else self.dp_size

    @property
    def counts_metrics(self) -> bool:
        """The ranks of a sequence-parallel group hold the same whole-sequence sums: only the first counts them."""
        return self.sp_rank == 0

    def as_dict(self) -> dict:
        """What a checkpoint and a report record: the sizes (not this process's rank)."""
        return {"world_size": self.world_size, "dp_size": self.dp_size, "sp_size": self.sp_size}

    def describe(self) -> str:
        return describe_sizes(self.as_dict())

    def check_process_group(self, rank: int, world_size: int) -> None:
        """After the process group starts: it must be the job the launcher announced."""
        if (rank, world_size) != (self.rank, self.world_size):
            raise RuntimeError(f"the process group says rank {rank} of {world_size}, the launcher announced rank "
                               f"{self.rank} of {self.world_size}")
