#!/usr/bin/env bash
# KV caches in fewer bytes on the CPU: one decoding step of our layer on burn-flex, every pool
# THREADS wide, width 768 and 12 heads, in interleaved rounds (drift on a shared machine lasts
# minutes). Each round times, for each cache type (f32, int8, f16, bf16), the dense cache after
# 16 383 positions at batch 1 and after 4 095 at batch 8, and the paged cache at batch 8; then
# kv_dtype_rounds.py prints each type's range and its ratio to f32, each ratio from one round.
#   benches/attention-bench/run-kv-dtypes.sh kv-dtypes.jsonl 5
#   python3 benches/attention-bench/kv_dtype_rounds.py kv-dtypes.jsonl   # again, from the file
# Needs a release build (cargo build --release -p attention-bench).
set -uo pipefail
out=${1:-kv-dtypes.jsonl}
rounds=${2:-5}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
runner=${RUNNER:-"$root/target/release/attention-bench"}
threads=${THREADS:-2}
repeats=${REPEATS:-20}
: > "$out"
# Tags a line with its round.
tag() { sed "s/^{/{\"round\":$1,/"; }
for round in $(seq "$rounds"); do
  for kv in f32 int8 f16 bf16; do
    for shape in 1x16384x768x12 8x4096x768x12; do
      "$runner" --backend flex --impl fused --threads "$threads" --repeats "$repeats" --warmup 2 \
        --mode decode --shape "$shape" --kv-dtype "$kv" | tag "$round" >> "$out"
    done
    "$runner" --backend flex --impl fused --threads "$threads" --repeats "$repeats" --warmup 2 \
      --mode decode --shape 8x4096x768x12 --cache paged --kv-dtype "$kv" | tag "$round" >> "$out"
  done
done
python3 "$here/kv_dtype_rounds.py" "$out"
