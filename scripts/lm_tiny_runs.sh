#!/usr/bin/env bash
# The lm-tiny comparison of docs/extensions.md: the three causal mixers, seeds 0-2, one after
# another on one thread (a shared machine), into runs/extensions/lm/<mixer>-s<seed>.
# Usage: scripts/lm_tiny_runs.sh [SEEDS...]   (default: 0 1 2)
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
seeds=("${@:-0 1 2}")
for seed in ${seeds[@]}; do
  for preset in lm-tiny lm-tiny-attention lm-tiny-flarepp; do
    out="runs/extensions/lm/${preset}-s${seed}"
    if [ -f "$out/metrics.json" ]; then continue; fi
    extra=()
    if [ -d "$out/checkpoints" ]; then extra=(--resume); fi
    .venv/bin/python -m flarepp train "$preset" --out "$out" --set seed="$seed" --quiet \
      --device cpu "${extra[@]}" > "$out.log" 2>&1 || echo "failed: $out (see $out.log)"
  done
done
