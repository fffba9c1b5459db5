#!/usr/bin/env bash
# The conditioning comparison of docs/extensions.md: Cross FLARE, concatenation and
# AdaLN-Zero on the advection-diffusion rollout, one after another on one thread, into
# runs/extensions/rollout/<preset>-s<seed>. Makes the data first if it is missing.
# Usage: scripts/rollout_runs.sh [SEEDS...]   (default: 0 1 2)
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
data=data/advection-diffusion
if [ ! -f "$data/advection_diffusion_train.npz" ]; then
  .venv/bin/python -m flarepp data make advection-diffusion --out "$data" --train 256 \
    --test 64 --resolution 16 --quiet || exit 1
fi
mkdir -p runs/extensions/rollout
for seed in ${@:-0 1 2}; do
  for preset in rollout-tiny rollout-tiny-concat rollout-tiny-adaln; do
    out="runs/extensions/rollout/${preset}-s${seed}"
    if [ -f "$out/metrics.json" ]; then continue; fi
    extra=()
    if [ -d "$out/checkpoints" ]; then extra=(--resume); fi
    .venv/bin/python -m flarepp train "$preset" --data "$data" --out "$out" \
      --set seed="$seed" --quiet --device cpu "${extra[@]}" > "$out.log" 2>&1 \
      || echo "failed: $out (see $out.log)"
  done
done
