"""Starting the process group, and telling a failed collective (a dead or stalled peer) from a bug.

The collective timeout bounds every collective of the run, so a dead rank ends its
peers with an error instead of a hang; :func:`is_collective_failure` lets the loop turn
that error into one line naming what to do (exit code 5), and :func:`lost_peers` names
the ranks that died or stalled (their host and pid), by a roll call in the job's
rendezvous store: among hundreds of ranks on dozens of nodes, which one is the question.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import io
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import deepspeed
import torch.distributed as dist
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT

from ..errors import PeerFailureError, first_line, run_guarded
from . import stop
from .build_lock import remove_stale_locks, use_venv_extensions
from .layout import ParallelLayout, free_port, launched

# Set by the deepspeed launcher and torchrun; under mpirun they are missing and come from MPI discovery.
RENDEZVOUS_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
SHM_DIR = Path("/dev/shm")
ROLL_CALL = "ds_packdpo/roll_call"  # the keys of the roll call in the rendezvous store
# How long the survivors of a failed collective wait for each other's answer: gloo fails every survivor of a dead rank
# within milliseconds (measured here); each second of it is added to the time a death takes to end the job.
ROLL_CALL_S = 2.0


def init_process_group(layout: ParallelLayout, collective_timeout_s: float, quiet: bool = False) -> None:
    """Starts the process group once per process (a bench measures several configurations in one) and checks
    that it is the job ``layout`` was made for; ``quiet``: without DeepSpeed's line on its CPU comm op's build."""
    if not dist.is_initialized():
        if not faulthandler.is_enabled() and sys.__stderr__ is not None:
            # A rank that dies of a fatal signal (a C++ abort or segfault in a library) prints every thread's Python
            # stack first, so that its log says where.
            faulthandler.enable(file=sys.__stderr__)
        use_venv_extensions()  # a rank started by hand finds the op where this venv built it
        if launched():
            stop.end_at_once()  # a rank's SIGINT before the loop, as its SIGTERM
        remove_stale_locks()  # init_distributed JIT-builds DeepSpeed's CPU comm extension: a stale lock hangs it
        if not all(key in os.environ for key in RENDEZVOUS_ENV):
            if not launched() and "MASTER_PORT" not in os.environ:
                # A lone process (check, eval or a one-rank run without a launcher) is its own rendezvous: any free
                # port, not DeepSpeed's default 29500, which another job on this machine may hold (seen: EADDRINUSE).
                os.environ["MASTER_PORT"] = str(free_port())
            # DeepSpeed's MPI discovery (what init_distributed(auto_mpi_discovery=True) runs) sets MASTER_PORT to its
            # argument, not to the environment's, and MASTER_ADDR to rank 0's first `hostname -I` address: run it
            # here with the job's port, then put back an address the job gave (launch/mpirun.sh exports both).
            master_addr = os.environ.get("MASTER_ADDR")
            deepspeed.comm.mpi_discovery(int(os.environ.get("MASTER_PORT", TORCH_DISTRIBUTED_DEFAULT_PORT)),
                                         verbose=False)
            if master_addr:
                os.environ["MASTER_ADDR"] = master_addr
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            deepspeed.init_distributed(timeout=timedelta(seconds=collective_timeout_s), auto_mpi_discovery=True,
                                       verbose=False)
        release_shm_buffer()
        if dist.get_world_size() > 1:
            _rendezvous_store(collective_timeout_s).set(f"{ROLL_CALL}/who/{dist.get_rank()}",
                                                        f"{socket.gethostname()}, pid {os.getpid()}")
    layout.check_process_group(dist.get_rank(), dist.get_world_size())


def shm_buffer_name(addr: str, port: str, rank) -> str:
    """The name of DeepSpeed's CPU comm op buffer in /dev/shm (deepspeed/ops/csrc/cpu/comm/shm.cpp names it by user,
    rendezvous address and port, and rank); ``"*"`` parts make it a glob pattern."""
    return f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def release_shm_buffer() -> None:
    """Unlinks this rank's 66 MB /dev/shm buffer of DeepSpeed's CPU comm op once every rank has mapped it.

    ``init_distributed`` builds the op on CPU and, when every rank is on one node, each rank creates its buffer
    there and maps every other rank's, but nothing ever unlinks them: each job left 66 MB per rank in /dev/shm
    (memory) for good, and a day of launches on free ports filled it (seen here: 21 GB, the machine swapping and
    a compiler killed for memory).  Unlinked after a barrier (every rank has opened every buffer by then), the
    mappings live on until the processes exit, and the memory goes with them, crash or not.
    """
    if getattr(deepspeed.comm.comm.cdb, "shm_comm_op", None) is None:
        return
    dist.barrier()
    name = shm_buffer_name(os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), dist.get_rank())
    (SHM_DIR / name).unlink(missing_ok=True)


def _rendezvous_store(timeout_s: float) -> dist.TCPStore:
    """A client of the job's rendezvous store (torch's env:// rendezvous: a TCPStore that rank 0's process serves on
    MASTER_ADDR:MASTER_PORT), apart from the process group's own connections."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def lost_peers() -> str:
    """After a failed collective, who failed, as the subject of the rank's error line.

    Every survivor answers a roll call in the rendezvous store and waits up to ROLL_CALL_S for
    the others; the ranks that did not answer are named with the host and pid each left there
    as the group started ("rank 1 (node2, pid 4242) did not answer within 2 s: it died or
    stalled").  A store that cannot be reached went with the process that served it: rank 0's.
    No roll call in a rank its launcher is stopping (a stop signal came: DeepSpeed's launcher
    sends SIGTERM to the others when one of its ranks died): the job is ending already.
    Never raises: it runs while a failure is being reported, which it must not replace.
    """
    if stop.requested():
        return "another rank died or stalled"
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        try:
            store = _rendezvous_store(ROLL_CALL_S)
        except Exception:  # noqa: BLE001 -- no store to reach: its server, rank 0's process, is gone
            if rank == 0:
                raise
            return f"rank 0 (on {os.environ['MASTER_ADDR']}, whose rendezvous store is unreachable) died or stalled"
        store.set(f"{ROLL_CALL}/here/{rank}", "")
        deadline = time.monotonic() + ROLL_CALL_S
        while missing := [r for r in range(world_size) if not store.check([f"{ROLL_CALL}/here/{r}"])]:
            if time.monotonic() >= deadline:
                who = ", ".join(f"rank {r} ({store.get(f'{ROLL_CALL}/who/{r}').decode()})" for r in missing)
                return f"{who} did not answer within {ROLL_CALL_S:g} s: {'it' if len(missing) == 1 else 'they'} " \
                       "died or stalled"
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 -- no roll call (no process group, no store): the failure is reported without it
        pass
    return "another rank died or stalled"


def is_collective_failure(error: RuntimeError) -> bool:
    """A collective that failed because a peer died or stalled (gloo/NCCL/c10d errors), not a bug of ours."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(key in text for key in ("gloo", "NCCL", "c10d"))


def close_process_group() -> None:
    """Tears the process group down at the end of a completed run, before the interpreter exits.

    Left to interpreter shutdown, gloo's teardown was seen aborting a finished rank while rank 0
    still exported ("terminate called without an active exception", exit -6), failing the job.
    The ranks meet at a barrier first (gloo's waits for every collective queued or running before
    it), so no rank tears down while a peer still has collectives in flight, and a peer lost after
    the last step is one line and exit 5; nothing long may run on one rank before this call
    (--export-on-end runs after it).  The barrier alone did not stop the abort at exit (a 2-rank
    run with nothing left to do still aborted once): :func:`exit_rank` does.  Only on success:
    after a failed collective the peers may be gone.
    """
    if dist.is_initialized():
        try:
            dist.barrier()
        except RuntimeError as error:
            if not is_collective_failure(error):
                raise
            raise PeerFailureError(f"rank {dist.get_rank()}: {lost_peers()} after the last step "
                                   f"({first_line(error)})") from error
        dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """Ends a rank's process with ``code`` once its job has returned, without the interpreter's finalization.

    Finished ranks were seen aborting after their job had returned, every step, metric and
    checkpoint written and the process group closed ("terminate called without an active
    exception", SIGABRT; faulthandler: the main thread past its last Python frame), so the launcher
    failed a complete job (exit 250): gloo's objects torn down during finalization.  Here the exit
    handlers run (logging, monitors such as wandb, multiprocessing), the standard streams are
    flushed, and os._exit ends the process.  Under MPI (mpi4py imported: launch/mpirun.sh) the
    normal exit stays, for MPI_Finalize.
    """
    if "mpi4py" in sys.modules:
        sys.exit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_rank_job(work: Callable[[], dict | None]) -> int:
    """One rank of a command that reports JSON (precompute-ref, eval): ``work()``, the process group closed, then
    the result printed (rank 0's; the other ranks return None); bad input and failures as :func:`run_guarded` ends
    them."""

    def job() -> int:
        result = work()
        close_process_group()
        if result is not None:
            print(json.dumps(result, indent=2))
        return 0

    return run_guarded(job)
