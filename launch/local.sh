#!/usr/bin/env bash
# One node, one rank per GPU: the deepspeed launcher around `python -m ds_packdpo.train`.
#
#   launch/local.sh [ds_packdpo.train flags]
#   NUM_GPUS=4 launch/local.sh --model /models/llama-3-8b --dataset prefs.jsonl --ds-config zero3
#
# Environment:
#   NUM_GPUS     ranks on this node (default: every visible GPU; on a CPU-only machine set it, e.g. 2)
#   MASTER_PORT  rendezvous port (default: a port that is free right now, so two jobs on one node never collide)
# Every argument is handed to the trainer unchanged.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

if [[ -z "${MASTER_PORT:-}" ]]; then
    MASTER_PORT=$(python -c 'from ds_packdpo.cli import free_port; print(free_port())')
fi
launcher_args=(--master_port "$MASTER_PORT")
if [[ -n "${NUM_GPUS:-}" ]]; then
    launcher_args+=(--num_gpus "$NUM_GPUS")
fi
exec deepspeed "${launcher_args[@]}" --module ds_packdpo.train "$@"
