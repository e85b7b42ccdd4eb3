#!/usr/bin/env bash
# The GPU acceptance run: one command on a bare one-GPU machine with no network (an H200 here), under 9 minutes
# (BUDGET_S, 510 s: a stage starts only with 30 s of it left and is cut at its end), writing JSON and a Markdown
# summary into OUT.  The stages run in the order they tell most: profile and tune first, what earlier runs measured
# last.
#
#   scripts/fetch_gpu_wheels.sh            # first, on a machine with network: .whl/ and .gpu_data/ (git-ignored)
#   scripts/gpu_acceptance.sh OUT [--smoke]
#
# OUT receives at most 8 files, refreshed after every stage (a run cut short still leaves its report):
# acceptance.json / acceptance.md (every figure), matrix.json, bench_report.json, tokens_per_s.png,
# train_metrics.jsonl, trl.json, logs.txt (the tail of each stage's log).  Everything else is written under
# $GPU_ACCEPTANCE_WORK (default /tmp/ds_packdpo_acceptance).
#
# Stages (each under its own time limit; a failed stage is recorded and the next one still runs):
#   install  the packages the GPU image lacks, from .whl/, into .gpu_site/ (put first on PYTHONPATH)
#   setup    the model config, tokenizer and DeepSpeed config of the runs below
#   profile  the train stage's run, steps 2-3 under torch.profiler (--profile-steps): the step's GPU time by category
#            (GEMMs, attention, log-prob stage, elementwise, ZeRO-3 collectives, optimizer, idle), FLOPs per category
#   tune     the train stage once per variant of TUNE_VARIANTS (names of scripts/gpu_tune.py's VARIANTS: compile,
#            liger, logps=fused|lean, row-budget=16k|32k|64k, zero3-*, no-overlap-comm, ref-whole, activation-checkpointing;
#            A+B for both), each in its own process, TUNE_STEPS steps, TUNE_LIMIT s each: one MFU / tokens/s /
#            peak-memory table, with each variant's step 1 (same weights, same pairs) against the first variant's
#   train    1-GPU ZeRO-3 bf16 DPO of a random Llama-3.2-1B-shaped model on dpo_en_demo.json, max length 4096,
#            16k-token rows, --attn auto (torch_varlen without flash-attn): tokens/s, pairs/s, MFU, peak memory
#   bench    the same model: packed (prefix-shared) vs packed-no-prefix-sharing vs padded vs packed-sdpa-varlen, in
#            rounds, through ds-packdpo bench's front process: a configuration that crashes is named with its error
#            (a CUDA error rerun alone with CUDA_LAUNCH_BLOCKING=1, the kernel named) and the others measured again
#   bench_groups  packed vs packed-no-prompt-groups on multi_response_demo.jsonl (every pair of 4 answers)
#   trl      TRL's DPOTrainer on the same model, data, pairs per step and length: pairs/s
#   logps    scripts/gpu_logps.py: the log-prob stage of a 16k-token row at a 128k vocabulary, full logits vs lean
#            chunks vs the fused kernel (cut-cross-entropy): peak memory, time, difference from fp32
#   matrix   scripts/gpu_check.py: every architecture x {torch_varlen bf16, sdpa_varlen fp32/bf16}, packed and
#            prefix-shared rows against eager one sequence at a time (log-probs and gradients), torch_varlen's
#            causal alignment and GQA probes, the bf16 guard figures
#   kernels  scripts/gpu_check.py --kernels-only: the attention kernels' probes alone
#   summary  OUT/acceptance.json and OUT/acceptance.md (after every stage)
# --smoke runs every stage on a CPU with a tiny model and few steps (this script's own check, not a benchmark);
# SKIP_STAGES="trl" (names separated by spaces) leaves stages out; STAGES="tune" runs those alone (with install and
# setup), e.g. STAGES="tune" TUNE_VARIANTS="default,row-budget=32k,row-budget=64k" for a second invocation.
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT=${1:?usage: scripts/gpu_acceptance.sh OUT [--smoke]}
SMOKE=${2:-}
mkdir -p "$REPORT"
REPORT=$(cd "$REPORT" && pwd)
OUT=${GPU_ACCEPTANCE_WORK:-/tmp/ds_packdpo_acceptance}
rm -rf "$OUT" && mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=${GPU_SITE:-$PWD/.gpu_site}  # scripts/gpu_image_smoke.sh installs into its own
WORK=$OUT/work
DATA=../shared/data/dpo_en_demo.json
[[ -f $DATA ]] || DATA=.gpu_data/dpo_en_demo.json  # the device machine gets no ../shared: fetch_gpu_wheels.sh copies it
MULTI_DATA=$(dirname "$DATA")/multi_response_demo.jsonl
export DPO_DEMO_DATA=$DATA
: > "$OUT/stages.jsonl"

bundle() {  # the report folder: at most 8 files
    "$PY" scripts/gpu_acceptance.py summarize "$OUT" > /dev/null 2>&1
    cp -f "$OUT/acceptance.json" "$OUT/acceptance.md" "$OUT/matrix.json" "$OUT/trl.json" "$REPORT/" 2>/dev/null
    cp -f "$OUT/bench/report.json" "$REPORT/bench_report.json" 2>/dev/null
    cp -f "$OUT/bench/tokens_per_s.png" "$REPORT/tokens_per_s.png" 2>/dev/null
    cp -f "$OUT/train/metrics.jsonl" "$REPORT/train_metrics.jsonl" 2>/dev/null
    for log in "$OUT"/*.log; do echo "#### $log"; tail -n 40 "$log"; done > "$REPORT/logs.txt"
}

BUDGET_S=${BUDGET_S:-510}  # the whole run's seconds (the device machine's 15 minutes hold start-up and a rerun too)
SCRIPT_STARTED=$(date +%s)

stage() {  # stage NAME SECONDS COMMAND...: output to OUT/NAME.log, exit code and time to OUT/stages.jsonl
    local name=$1 limit=$(( $2 * ${LIMIT_SCALE:-1} )) started rc left
    shift 2
    if [[ " ${SKIP_STAGES:-} " == *" $name "* ]]; then  # SKIP_STAGES="trl ...": stages to leave out
        return 0
    fi
    if [[ -n ${STAGES:-} && " $STAGES install setup " != *" $name "* ]]; then  # STAGES="tune ...": these alone
        return 0
    fi
    left=$(( BUDGET_S * ${LIMIT_SCALE:-1} - ($(date +%s) - SCRIPT_STARTED) ))
    if (( left < 30 )); then  # out of the run's budget: recorded, not started
        printf '{"stage": "%s", "rc": -1, "seconds": 0, "skipped": "budget"}\n' "$name" >> "$OUT/stages.jsonl"
        return 0
    fi
    (( limit > left )) && limit=$left
    started=$(date +%s%N)
    echo "== $name (limit ${limit}s): $*" | tee "$OUT/$name.log"
    timeout --kill-after=10 "$limit" "$@" >> "$OUT/$name.log" 2>&1
    rc=$?
    printf '{"stage": "%s", "rc": %d, "seconds": %d.%01d}\n' "$name" "$rc" $(( ($(date +%s%N) - started) / 1000000000 )) \
        $(( ($(date +%s%N) - started) / 100000000 % 10 )) >> "$OUT/stages.jsonl"
    tail -n 3 "$OUT/$name.log"
    bundle
    return 0
}

install_packages() {  # run by stage through bash -c (timeout runs commands, not functions)
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null
    if [[ -z $SMOKE || -n ${INSTALL_IN_SMOKE:-} ]]; then  # INSTALL_IN_SMOKE: scripts/gpu_image_smoke.sh's run
        mkdir -p "$SITE"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            .whl/*.whl || return 1
        DS_BUILD_OPS=0 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
            --target "$SITE" .whl/deepspeed-*.tar.gz || return 1
    fi
    "$PY" - <<'EOF'
import importlib, json, torch
versions = {name: getattr(importlib.import_module(name), "__version__", "?")
            for name in ("torch", "transformers", "deepspeed", "datasets", "trl", "tokenizers", "huggingface_hub",
                         "accelerate", "pyarrow", "pydantic")}
print(json.dumps({**versions, "cuda": torch.cuda.is_available(),
                  "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}))
EOF
}

export -f install_packages
export PY SMOKE SITE INSTALL_IN_SMOKE
export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}
export PATH=$SITE/bin:$PATH
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
if [[ -n $SMOKE ]]; then
    export DS_ACCELERATOR=cpu
    LIMIT_SCALE=${LIMIT_SCALE:-5}  # a shared CPU takes longer than the GPU machine the limits are set for
    MATRIX=(--device cpu --attn sdpa_varlen)
    RUN=(--dtype fp32 --max-length 512 --max-tokens-per-row 2048 --global-batch-pairs 8)
    TRAIN_STEPS=3; BENCH=(--configurations packed,padded --max-steps 2 --bench-warmup-steps 1 --bench-rounds 2)
    GROUPS_RUN=(--max-length 1024 --max-pairs 48 --global-batch-pairs 4 --max-steps 1 --bench-warmup-steps 0
                --bench-rounds 1)
    TRL=(--steps 3 --batch-pairs 8 --micro-batch-pairs 4 --max-length 512)
    TUNE_VARIANTS=${TUNE_VARIANTS:-default,row-budget=16k}; TUNE_STEPS=3; TUNE_LIMIT=60
else
    MATRIX=(--device cuda --attn torch_varlen,sdpa_varlen --dtypes ${MATRIX_DTYPES:-fp32,bf16})
    RUN=(--dtype bf16 --max-length 4096 --max-tokens-per-row 16384 --global-batch-pairs 32 --micro-batch-pairs 4
         --peak-tflops 989)
    TRAIN_STEPS=4
    # two rounds, the order rotated: each configuration once first, a fresh build each round (bench_rounds.py)
    BENCH=(--configurations packed,packed-no-prefix-sharing,padded,packed-sdpa-varlen --max-steps 2
           --bench-warmup-steps 1 --bench-rounds 2)
    GROUPS_RUN=(--dtype bf16 --max-length 4096 --max-tokens-per-row 16384 --global-batch-pairs 32 --max-steps 2
                --bench-warmup-steps 1 --bench-rounds 2 --peak-tflops 989)
    TRL=(--steps 3 --batch-pairs 32 --micro-batch-pairs 4 --max-length 4096)
    # the first invocation's levers; a second names what the first pointed at (docs/gpu.md)
    TUNE_VARIANTS=${TUNE_VARIANTS:-default,compile,liger,logps=fused,zero3-persist=all}; TUNE_STEPS=4; TUNE_LIMIT=75
fi
COMMON=(--model-config "$WORK/model" --tokenizer "$WORK/tokenizer" --dataset "$DATA"
        --ds-config "$WORK/zero3_torch_adam.json" --cache-dir "$WORK/cache" --lr 1e-6 --beta 0.1 --no-progress)

stage install 90 bash -c install_packages
stage setup 45 "$PY" scripts/gpu_acceptance.py setup "$WORK" ${SMOKE:+--smoke}
# first what tells most: where a step goes (steps 2-3 under torch.profiler, OUT/profile/profile.json)
stage profile 100 deepspeed --num_gpus 1 --master_port 29610 --module ds_packdpo.train "${COMMON[@]}" "${RUN[@]}" \
    --max-steps 3 --profile-steps 2 --skip-packing-check --output-dir "$OUT/profile" --overwrite
# then the levers: the train stage once per variant, each in its own process (scripts/gpu_tune.py's VARIANTS)
# each variant TUNE_LIMIT s, a compiling one more (scripts/gpu_tune.py's TIMEOUT_FACTOR, summed there)
stage tune $(( $("$PY" scripts/gpu_tune.py stage-limit "$TUNE_VARIANTS" "$TUNE_LIMIT") + 10 )) "$PY" scripts/gpu_tune.py \
    "$OUT/tune" --variants "$TUNE_VARIANTS" --steps "$TUNE_STEPS" --timeout-s $(( TUNE_LIMIT * ${LIMIT_SCALE:-1} )) \
    -- deepspeed --num_gpus 1 --master_port 29614 --module ds_packdpo.train "${COMMON[@]}" "${RUN[@]}"
stage train 130 deepspeed --num_gpus 1 --master_port 29611 --module ds_packdpo.train "${COMMON[@]}" "${RUN[@]}" \
    --max-steps "$TRAIN_STEPS" --output-dir "$OUT/train" --overwrite
# A start-up guard that refused the model (exit 3) is recorded by the train stage; the bench then measures with
# --skip-packing-check so that the run still yields its figures (acceptance.json says so).
grep -q '"stage": "train", "rc": 3' "$OUT/stages.jsonl" && BENCH+=(--skip-packing-check)
# ds-packdpo bench (the front process), not the rank module: a configuration that crashes costs that one alone
stage bench 210 "$PY" -m ds_packdpo.cli bench --num-procs 1 --master-port 29612 "${COMMON[@]}" "${RUN[@]}" \
    "${BENCH[@]}" --out "$OUT/bench"
stage bench_groups 120 "$PY" -m ds_packdpo.cli bench --num-procs 1 --master-port 29613 "${COMMON[@]/$DATA/$MULTI_DATA}" \
    --pairs-from all "${GROUPS_RUN[@]}" --configurations packed,packed-no-prompt-groups --out "$OUT/bench_groups"
stage trl 120 "$PY" scripts/gpu_acceptance.py trl "$WORK" "$OUT/trl.json" "${TRL[@]}"
# last what earlier runs measured already (docs/gpu.md): exactness per architecture, the kernels' probes, the log-prob
# stage alone (the tune stage's logps=fused row measures the fused kernel in a step)
[[ -z $SMOKE ]] && stage logps 60 "$PY" scripts/gpu_logps.py --json-out "$OUT/logps.json"
stage matrix 120 "$PY" scripts/gpu_check.py "${MATRIX[@]}" --json-out "$OUT/matrix.json"
stage kernels 60 "$PY" scripts/gpu_check.py "${MATRIX[@]}" --kernels-only
cat "$REPORT/acceptance.md" 2>/dev/null
