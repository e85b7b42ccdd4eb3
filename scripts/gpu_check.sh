#!/usr/bin/env bash
# Packing-exactness check on a CUDA machine: the architecture matrix with flash_attention_2 varlen and bf16,
# and the bf16 guard figures (under 5 minutes once flash-attn is installed).
#
#   scripts/gpu_check.sh [VENV] [-- extra args for scripts/gpu_check.py]
#
# VENV: a virtualenv to use (created with --system-site-packages when missing, so a
# preinstalled CUDA torch stays visible); default: the python on PATH.
# Installs what is missing: transformers (for the models) and flash-attn
# (`pip install flash-attn --no-build-isolation`: a prebuilt wheel when one matches
# torch/CUDA/python and the network allows, otherwise a long source build; set
# MAX_JOBS to bound it). The project itself is used from this checkout (PYTHONPATH).
# Prints the JSON report of scripts/gpu_check.py; exit 0 only when every check passed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=python3
if [[ $# -gt 0 && $1 != "--" ]]; then
    VENV=$1; shift
    [[ -x $VENV/bin/python ]] || python3 -m venv --system-site-packages "$VENV"
    PY=$VENV/bin/python
fi
[[ ${1:-} == "--" ]] && shift

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo '{"ok": false, "error": "no CUDA-enabled torch in '"$PY"' (install a CUDA build of torch first)"}'
    exit 2
fi
"$PY" -c "import transformers" 2>/dev/null || "$PY" -m pip install -q "transformers>=5.23" >&2
if ! "$PY" -c "import flash_attn" 2>/dev/null; then
    echo "gpu_check: installing flash-attn (may take long without a matching prebuilt wheel)" >&2
    "$PY" -m pip install -q packaging ninja psutil >&2 || true
    MAX_JOBS=${MAX_JOBS:-8} "$PY" -m pip install flash-attn --no-build-isolation >&2 \
        || echo "gpu_check: flash-attn could not be installed; its check will report not ok" >&2
fi

PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} exec timeout "${GPU_CHECK_TIMEOUT:-290}" "$PY" scripts/gpu_check.py "$@"
