#!/usr/bin/env bash
# The GPU kernel against Burn's attention op on the same wgpu adapter — on a machine without a
# GPU, Mesa's software Vulkan (lavapipe), so these are correctness-and-memory figures, not GPU
# speed: interleaved shape by shape over ROUNDS rounds, then forward+backward's peak RSS (device
# memory is host memory there) of the kernel route at growing lengths, each shape in a process of
# its own.
#   benches/attention-bench/run-lavapipe.sh lavapipe.jsonl
# Needs: a release build (cargo build --release -p attention-bench) and a Vulkan driver.
set -uo pipefail
out=${1:-lavapipe.jsonl}
root=$(cd "$(dirname "$0")/../.." && pwd)
runner=${RUNNER:-$root/target/release/attention-bench}
rounds=${ROUNDS:-2}
shapes=${SHAPES:-1x1024x768x12}
: > "$out"
tag() { sed "s/}\$/,\"round\":$1}/"; }

for round in $(seq "$rounds"); do
  for shape in $shapes; do
    for extra in "" "--num-kv-heads 3" "--sliding-window 128"; do
      for mode in fwd fwdbwd; do
        for impl in fused burn-op; do
          # shellcheck disable=SC2086
          timeout 600 "$runner" --backend wgpu --impl $impl --mode $mode --repeats 3 --warmup 1 \
            --shape "$shape" $extra | tag "$round" >> "$out"
        done
      done
    done
  done
done

# Memory: one forward+backward per process, the kernel route at 64 (the baseline) to 4096
# tokens; Burn's op (differentiated through its O(T²) composite) beside it where it fits.
for seq in 64 1024 2048 4096; do
  for impl in fused burn-op; do
    timeout 300 "$runner" --backend wgpu --impl $impl --mode fwdbwd --repeats 1 --warmup 0 \
      --shape "1x${seq}x768x12" | tag memory >> "$out" \
      || echo "{\"impl\":\"$impl\",\"shape\":\"1x${seq}x768x12\",\"failed\":true,\"round\":\"memory\"}" >> "$out"
  done
done
