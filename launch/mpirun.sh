#!/usr/bin/env bash
# MPI: OpenMPI's mpirun starts every rank as `python -m mpi4py -m ds_packdpo.train`; each rank finds its rank,
# world size and local rank with deepspeed.init_distributed(auto_mpi_discovery=True) (mpi4py).
# `pip install -e '.[mpi]'` (mpi4py + openmpi) gives a working mpirun with no system MPI.
#
#   launch/mpirun.sh [options] [--] [ds_packdpo.train flags]
#   launch/mpirun.sh -n 2 -- --max-steps 10                           # one node
#   launch/mpirun.sh -n 16 --hostfile launch/hostfile --master_addr node1 -- --model /models/m
#
# Options (each can also come from the environment variable in brackets):
#   -n, --np N           [NP]           number of ranks (default: the GPUs of this node, 2 without GPUs)
#   --hostfile FILE      [HOSTFILE]     "host slots=N" lines (the same format as the deepspeed hostfile)
#   --master_addr ADDR   [MASTER_ADDR]  rank 0's address (default: 127.0.0.1 on one node; with a hostfile
#                                       the first address of `hostname -I` on rank 0's node)
#   --master_port PORT   [MASTER_PORT]  rendezvous port (default: a free port on one node, 29500 with a hostfile)
# Options stop at "--" or at the first other argument; everything after goes to the trainer unchanged.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

die() { echo "launch/mpirun.sh: $*" >&2; exit 2; }

np=${NP:-}
hostfile=${HOSTFILE:-}
master_addr=${MASTER_ADDR:-}
master_port=${MASTER_PORT:-}

while [[ $# -gt 0 ]]; do
    case "$1" in
        -n|--np|--hostfile|--master_addr|--master_port)
            [[ $# -ge 2 ]] || die "$1 needs a value"
            case "$1" in
                -n|--np) np=$2 ;;
                --hostfile) hostfile=$2 ;;
                --master_addr) master_addr=$2 ;;
                --master_port) master_port=$2 ;;
            esac
            shift 2 ;;
        --) shift; break ;;
        *) break ;;
    esac
done

[[ -z "$hostfile" || -f "$hostfile" ]] || die "hostfile $hostfile: no such file"
if [[ -z "$np" ]]; then
    np=$(python -c 'import torch; print(torch.cuda.device_count() or 2)')
fi
mpi_args=(-n "$np" --bind-to none)  # ranks use many threads; OpenMPI would pin each to one core
if [[ -n "$hostfile" ]]; then
    mpi_args+=(--hostfile "$hostfile")
    master_port=${master_port:-29500}
else
    # One node: loopback, and a port nobody holds, so two jobs on one node never collide.
    mpi_args+=(--oversubscribe)  # OpenMPI counts cores as slots; allow more ranks than cores (CPU runs)
    master_addr=${master_addr:-127.0.0.1}
    if [[ -z "$master_port" ]]; then
        master_port=$(python -c 'from ds_packdpo.cli import free_port; print(free_port())')
    fi
fi
if [[ "$(id -u)" == 0 ]]; then
    mpi_args+=(--allow-run-as-root)
fi

# The trainer hands MASTER_PORT to DeepSpeed's MPI discovery and keeps a MASTER_ADDR it is given.
export MASTER_PORT=$master_port
mpi_args+=(-x MASTER_PORT)
if [[ -n "$master_addr" ]]; then
    export MASTER_ADDR=$master_addr
    mpi_args+=(-x MASTER_ADDR)
fi
for var in "${JOB_ENV[@]}" PYTHONPATH CUDA_VISIBLE_DEVICES; do
    if [[ -n "${!var:-}" ]]; then
        mpi_args+=(-x "$var")
    fi
done

# `python -m mpi4py`: a rank that fails (exception or non-zero exit) aborts the whole job instead of leaving
# its peers waiting in MPI_Finalize or a rendezvous.
exec mpirun "${mpi_args[@]}" python -m mpi4py -m ds_packdpo.train "$@"
