#!/usr/bin/env bash
# What BENCHMARKS.md's GPU and thread-scaling tables report, on a machine with a CUDA GPU,
# a Vulkan driver and PyTorch:
#  1. our wgpu fused path (the GPU kernel), our layer on Burn's attention op, and PyTorch's CUDA
#     SDPA layer, forward and forward+backward, float32,
#     alternating ours / PyTorch for each mode, ROUNDS rounds;
#  2. our CPU kernel (flex and ndarray, fused) and PyTorch's CPU sdpa at 1, 2, 4, … threads.
#   benches/attention-bench/run-gpu.sh gpu-results.jsonl
# Needs: a release build (cargo build --release -p attention-bench); PyTorch with CUDA as
# $TORCH_PYTHON (default python3); ../shared/peers/torch_mha.py (or $PEER_CPU).
set -uo pipefail
out=${1:-gpu-results.jsonl}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
runner=${RUNNER:-$root/target/release/attention-bench}
py=${TORCH_PYTHON:-python3}
peer_cpu=${PEER_CPU:-$root/../shared/peers/torch_mha.py}
rounds=${ROUNDS:-3}
gpu_shapes=${GPU_SHAPES:-4x512x768x12 1x1024x768x12 1x2048x768x12 1x4096x768x12}
cpu_shapes=${CPU_SHAPES:-4x512x768x12 1x1024x768x12}
max_threads=${MAX_THREADS:-$(nproc)}
: > "$out"

shape_args() { for s in "$@"; do printf -- '--shape %s ' "$s"; done; }
# Tags every JSON line with the round and, for the CPU part, the threads.
tag() { sed "s/}\$/,\"round\":$1}/"; }

for round in $(seq "$rounds"); do
  for mode in fwd fwdbwd; do
    for impl in fused burn-op; do
      # shellcheck disable=SC2046
      timeout 300 "$runner" --backend wgpu --impl $impl --mode $mode --repeats 10 --warmup 3 \
        $(shape_args $gpu_shapes) | tag "$round" >> "$out"
    done
    "$py" "$here/peer_cuda.py" --mode $mode --repeats 10 --warmup 3 \
      --shapes "$(echo $gpu_shapes | tr ' ' ',')" | tag "$round" >> "$out"
  done
  # shellcheck disable=SC2046
  timeout 120 "$runner" --backend wgpu --impl fused --mode decode --repeats 20 --warmup 3 \
    $(shape_args ${DECODE_SHAPES:-1x1024x768x12 8x1024x768x12}) | tag "$round" >> "$out"
done

# Grouped-query (3 key/value heads for 12) and window-512 attention at 4096 tokens beside
# multi-head, on wgpu and on the CPU kernel with every core.
long=${LONG_SHAPE:-1x4096x768x12}
for extra in "" "--num-kv-heads 3" "--sliding-window 512"; do
  for mode in fwd fwdbwd; do
    # shellcheck disable=SC2086
    timeout 120 "$runner" --backend wgpu --impl fused --mode $mode --repeats 10 --warmup 3 \
      --shape "$long" $extra | tag 1 >> "$out"
    # shellcheck disable=SC2086
    timeout 120 "$runner" --backend flex --impl fused --mode $mode --repeats 3 --warmup 1 \
      --shape "$long" $extra | tag 1 >> "$out"
  done
done

for round in $(seq 2); do
  for threads in 1 2 4 8 16 32 64; do
    [ "$threads" -gt "$max_threads" ] && break
    for backend in flex ndarray; do
      # shellcheck disable=SC2046
      timeout 120 "$runner" --backend $backend --impl fused --mode fwd --repeats 5 --warmup 1 \
        --threads "$threads" $(shape_args $cpu_shapes) | tag "$round" >> "$out"
    done
    "$py" "$peer_cpu" --impl sdpa --mode fwd --threads "$threads" --repeats 5 --warmup 1 \
      --shapes "$(echo $cpu_shapes | tr ' ' ',')" | tag "$round" >> "$out"
  done
done
