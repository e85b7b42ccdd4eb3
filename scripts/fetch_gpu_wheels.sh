#!/usr/bin/env bash
# Fetches into .whl/ (git-ignored) what scripts/gpu_acceptance.sh installs on a GPU machine without network, and
# copies the demo data into .gpu_data/ (git-ignored):
# the packages its image lacks, as Python 3.12 x86_64 wheels, and DeepSpeed as its sdist (PyPI has no wheel;
# gpu_acceptance.sh builds it there with DS_BUILD_OPS=0, pure Python, no CUDA compile).
#
#   scripts/fetch_gpu_wheels.sh [PYTHON_VERSION]     # default 3.12, the GPU image's
#
# The GPU image (KINDS.md: torch 2.11, transformers 5.17, huggingface_hub 1.33, tokenizers 0.23.2, accelerate,
# peft, pyarrow, pandas, ...) lacks deepspeed, datasets, pydantic, hjson, dill, multiprocess and trl, and its
# transformers is older than this project's floor: transformers 5.23.0 is the newest whose requirements
# (huggingface_hub >= 1.31, tokenizers >= 0.23.1) that image meets; regex is carried because transformers
# checks its version at import.  Everything is fetched with --no-deps: the list below is the closure.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${1:-3.12}
mkdir -p .whl
WHEELS=(
    "transformers==5.23.0" "regex==2026.11.19"
    "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19"
    "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0" "typing-inspection==0.4.5"
    "typing-extensions==4.16.0"
    "hjson==3.1.0"
    "trl==1.16.0"
    "cut-cross-entropy==25.1.1"  # --logps-impl fused; its Triton comes with the image's CUDA torch
    "liger-kernel==0.8.5"  # --liger-kernels (the tune stage's liger row); Triton as above
)
python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$PYVER" \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -d .whl "${WHEELS[@]}"
python3 -m pip download -q --no-deps --no-binary=:all: -d .whl "deepspeed==0.19.8"
# the demo data: the device machine receives the checkout alone, not ../shared beside it
mkdir -p .gpu_data && cp ../shared/data/dpo_en_demo.json ../shared/data/multi_response_demo.jsonl .gpu_data/
du -sh .whl .gpu_data
ls .whl
