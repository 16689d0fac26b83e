#!/usr/bin/env bash
# Measures everything BENCHMARKS.md reports, in one run, into one JSON-lines file:
# our runner for every backend × implementation × mode, and PyTorch (ref, sdpa) beside it.
#   benches/attention-bench/run-all.sh results.jsonl     # also results-rounds.jsonl (run-rounds.sh)
# Needs: a release build (cargo build --release -p attention-bench), PyTorch in ~/torch-venv
# (see ../shared/peers/README.md), and for wgpu a Vulkan adapter.
set -uo pipefail
out=${1:-results.jsonl}
root=$(cd "$(dirname "$0")/../.." && pwd)
runner="$root/target/release/attention-bench"
torch_py=${TORCH_PYTHON:-$HOME/torch-venv/bin/python}
peer="$root/../shared/peers/torch_mha.py"
export RAYON_NUM_THREADS=2
tables="1x6x4x2 8x128x256x4 4x512x768x12 1x1024x768x12 1x2048x768x12"
curve="1x128x768x12 1x256x768x12 1x512x768x12"
: > "$out"

shape_args() { for s in "$@"; do printf -- '--shape %s ' "$s"; done; }

"$torch_py" "$peer" --sgemm 1024,2048 --threads 2 --repeats 10 >> "$out"
for mode in fwd fwdbwd; do
  for impl in ref sdpa; do
    "$torch_py" "$peer" --impl $impl --mode $mode --threads 2 --repeats 5 \
      --shapes "$(echo $tables $curve | tr ' ' ',')" >> "$out"
  done
done
for backend in ndarray flex wgpu; do
  for impl in explicit fused burn-nn; do
    for mode in fwd fwdbwd decode; do
      [ "$impl/$mode" = "burn-nn/decode" ] && continue
      # lavapipe (software Vulkan) is too slow for more than forward and decode of our paths.
      [ "$backend" = wgpu ] && { [ "$impl" = burn-nn ] || [ "$mode" = fwdbwd ]; } && continue
      shapes="$tables"
      [ "$mode" != decode ] && shapes="$tables $curve"
      # shellcheck disable=SC2046
      limit=300; [ "$backend" = wgpu ] && limit=150   # lavapipe is a software GPU
      timeout $limit "$runner" --backend $backend --impl $impl --mode $mode --repeats 5 --warmup 1 \
        $(shape_args $shapes) >> "$out" || echo "{\"backend\":\"$backend\",\"impl\":\"$impl\",\"mode\":\"$mode\",\"error\":\"failed or timed out\"}" >> "$out"
    done
  done
done
# The CPU targets' figures: ours and PyTorch interleaved shape by shape, 1 and 2 threads, 3 rounds
# (min–max of the per-round medians and per-round ratios: rounds.py).
RUNNER="$runner" "$root/benches/attention-bench/run-rounds.sh" "${out%.jsonl}-rounds.jsonl" 3
# Long context: forward at 16k and forward+backward at 4k tokens, best CPU path.
timeout 900 "$runner" --backend flex --impl fused --mode fwd --repeats 1 --warmup 0 --shape 1x16384x768x12 >> "$out"
timeout 900 "$runner" --backend flex --impl fused --mode fwdbwd --repeats 1 --warmup 0 --shape 1x4096x768x12 >> "$out"
