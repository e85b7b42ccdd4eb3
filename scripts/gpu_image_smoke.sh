#!/usr/bin/env bash
# The GPU image's software on this CPU machine: a virtual environment with the Python packages the device machine's
# image holds (KINDS.md's pip list, 2026-11: torch 2.11.0+cu130, transformers 5.17.0, huggingface_hub 1.33.0, ...),
# the wheels of scripts/fetch_gpu_wheels.sh installed (into the venv's gpu_site/) as gpu_acceptance.sh installs them there,
# then that script's CPU smoke run in it.  An incompatibility with the image's versions (an API torch 2.11 lacks, a
# carried wheel that does not import) then costs a few CPU minutes here instead of a try of a GPU session.
#
#   scripts/gpu_image_smoke.sh OUT [STAGES]     # STAGES as gpu_acceptance.sh's ("tune"); the venv: $GPU_IMAGE_VENV
#
# The first call builds the venv (~5 GB: torch's CUDA build and its CUDA libraries, which it needs to import; ~2
# minutes from the registry); later calls reuse it.  CUDA is absent here, so what runs is the smoke run's CPU path
# with the image's packages, not the GPU's kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
REPORT=${1:?usage: scripts/gpu_image_smoke.sh OUT [STAGES]}
VENV=${GPU_IMAGE_VENV:-/tmp/ds_packdpo_gpu_image}
# the image's versions where KINDS.md gives them; the rest are what the acceptance script's stages import
IMAGE_PACKAGES=(torch==2.11.0 triton==3.6.0 transformers==5.17.0 huggingface_hub==1.33.0 tokenizers==0.23.2
                accelerate==1.15.0 numpy==2.5.2 safetensors==0.8.0 peft pyarrow pandas matplotlib tqdm pyyaml psutil
                jinja2 einops msgpack ninja py-cpuinfo nvidia-ml-py xxhash fsspec requests aiohttp filelock)
if [[ ! -f $VENV/.installed ]]; then
    PY312=${PY312:-python3.12}  # the image's Python; pyenv's shim answers only for its selected version
    "$PY312" --version > /dev/null 2>&1 || PY312=$(ls -d "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 \
                                                 2>/dev/null | tail -n 1)
    if ! "${PY312:-python3.12}" --version > /dev/null 2>&1; then
        echo "error: scripts/gpu_image_smoke.sh needs Python 3.12, the GPU image's: set PY312 to one" >&2
        exit 2
    fi
    rm -rf "$VENV"
    "$PY312" -m venv "$VENV"
    "$VENV/bin/pip" install -q "${IMAGE_PACKAGES[@]}"
    touch "$VENV/.installed"
fi
[[ -d .whl ]] || scripts/fetch_gpu_wheels.sh 3.12
# into the venv's own site folder: the checkout's .gpu_site/ is put on every acceptance run's path, a CPU smoke run's too
STAGES=${2:-${STAGES:-}} INSTALL_IN_SMOKE=1 GPU_SITE=$VENV/gpu_site PYTHON=$VENV/bin/python \
    scripts/gpu_acceptance.sh "$REPORT" --smoke
