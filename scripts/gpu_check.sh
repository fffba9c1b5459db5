#!/usr/bin/env bash
# The one GPU check (`make gpu-check`): everything that needs CUDA, on one GPU, in at most
# 8 minutes.
#
#   1. pytest on every test marked `cuda`, in every file under tests/ (tests/test_cuda.py:
#      the fused CUDA log-sum-exp encode against float64 with both cotangents and its
#      memory at N = 2^20, two context-parallel ranks sharing the GPU, streaming, a 1-rank
#      NCCL group through the context-parallel and DDP paths, bf16/fp16 model outputs
#      against fp32; tests/test_cuda_training.py: the trainer in fp32/bf16/fp16 with the
#      scaler, pinned loaders, GPU<->CPU resume), at most TESTS_TIMEOUT seconds (default 240);
#   2. the Figure 6 sweep (paper D.3): `flarepp bench scaling --device cuda --dtype bf16`
#      for attention, flare and flarepp from 1k to 1M tokens at B = 8, C = 128, H = 8,
#      M = 64 and BLOCKS blocks (default 8), printing the table. Points that would not fit
#      the GPU's memory (at B = 8 and 8 blocks, the largest N), whose estimated steps
#      exceed POINT_BUDGET seconds (default 60) or that would end the sweep past
#      SWEEP_BUDGET seconds (default 170) are skipped with the reason, and so is a point
#      that runs out of memory anyway; any other failure of a point (a kernel's input
#      error, a worker killed) makes the sweep exit 1. The process is stopped at
#      SWEEP_TIMEOUT seconds (default 230).
#
# Writes runs/gpu-check/scaling.{json,csv,png}. Exit status: 0 when both parts pass.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/gpu-check}

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu-check: torch sees no CUDA GPU here ($("$PY" -c 'import torch; print(torch.__version__)')); nothing to check" >&2
    exit 2
fi
"$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'gpu-check on {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}')"

start=$(date +%s)
# The whole tests/ tree filtered by the marker, not a list of files: a new cuda-marked
# test file is run without touching this script (tests/test_gpu_check.py checks it).
timeout "${TESTS_TIMEOUT:-240}" "$PY" -m pytest -q -s -rs -m cuda -p no:cacheprovider tests
tests_status=$?
echo "gpu-check: cuda tests exit status ${tests_status} after $(( $(date +%s) - start )) s"

mkdir -p "$OUT"
timeout "${SWEEP_TIMEOUT:-230}" "$PY" -m flarepp bench scaling --device cuda --dtype bf16 \
    --mixers attention,flare,flarepp --n 1k,2k,4k,8k,16k,32k,64k,128k,256k,512k,1M \
    --batch 8 --dim 128 --heads 8 --latents 64 --blocks "${BLOCKS:-8}" --warmup 1 --repeats 3 \
    --time-budget "${POINT_BUDGET:-60}" --total-budget "${SWEEP_BUDGET:-170}" \
    --json "$OUT/scaling.json"
sweep_status=$?
echo "gpu-check: sweep exit status ${sweep_status}; total $(( $(date +%s) - start )) s"
[ "$tests_status" -eq 0 ] && [ "$sweep_status" -eq 0 ]
