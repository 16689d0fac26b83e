#!/usr/bin/env bash
# Paged KV cache on the CPU: one decoding step of our layer on burn-flex, every pool THREADS wide,
# width 768 and 12 heads, in interleaved rounds (drift on a shared machine lasts minutes). Each
# round times, case by case (the case tags each line):
#   ragged      8 rows at lengths 32, 64, …, 4096 (shape 8x4096): paged (pages of PAGE), and the
#               same rows padded to 4096 in a dense cache, their padding keys masked;
#   pages-N     the ragged rows in pages of 32, 64 and 128;
#   equal       every row at the shape's length: paged against dense at 1x1024, 8x1024, 1x16384;
#   before      a dense decoding step and a forward pass with the runner built before the paged
#               cache (BEFORE) and after it, for "no CPU target slower than before".
# Then paged_rounds.py prints each case's range and the ratios, each from one round, with their
# range over rounds.
#   benches/attention-bench/run-paged.sh paged.jsonl 5
#   python3 benches/attention-bench/paged_rounds.py paged.jsonl   # again, from the file
# Needs release builds (cargo build --release -p attention-bench; BEFORE: the same, built at the
# commit before the paged cache, or left out).
set -uo pipefail
out=${1:-paged.jsonl}
rounds=${2:-5}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
runner=${RUNNER:-"$root/target/release/attention-bench"}
before=${BEFORE:-}
threads=${THREADS:-2}
repeats=${REPEATS:-10}
page=${PAGE:-128}
lengths=32,64,128,256,512,1024,2048,4096
: > "$out"
# Tags a line with its round, case and binary.
tag() { sed "s/^{/{\"round\":$1,\"case\":\"$2\",\"build\":\"$3\",/"; }
bench() {
  local binary=$1
  shift
  "$binary" --backend flex --impl fused --threads "$threads" --repeats "$repeats" --warmup 2 "$@"
}
for round in $(seq "$rounds"); do
  for cache in paged dense; do
    bench "$runner" --mode decode --shape 8x4096x768x12 --cache "$cache" --page-size "$page" \
      --lengths "$lengths" | tag "$round" ragged after >> "$out"
  done
  for size in 32 64 128; do
    bench "$runner" --mode decode --shape 8x4096x768x12 --cache paged --page-size "$size" \
      --lengths "$lengths" | tag "$round" "pages-$size" after >> "$out"
  done
  for shape in 1x1024x768x12 8x1024x768x12 1x16384x768x12; do
    for cache in paged dense; do
      bench "$runner" --mode decode --shape "$shape" --cache "$cache" --page-size "$page" |
        tag "$round" equal after >> "$out"
    done
  done
  if [ -n "$before" ]; then
    for build in before after; do
      binary=$runner
      [ "$build" = before ] && binary=$before
      bench "$binary" --mode decode --shape 8x1024x768x12 | tag "$round" before "$build" >> "$out"
      bench "$binary" --mode fwd --shape 1x1024x768x12 | tag "$round" before "$build" >> "$out"
      bench "$binary" --mode fwdbwd --shape 1x1024x768x12 | tag "$round" before "$build" >> "$out"
    done
  fi
done
python3 "$here/paged_rounds.py" "$out"
