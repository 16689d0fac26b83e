#!/usr/bin/env bash
# The CPU targets' figures: our fused path on flex and ndarray and PyTorch's sdpa, interleaved
# shape by shape and thread count by thread count (drift on a shared machine lasts minutes), over
# several rounds, at 1 and 2 threads of every pool (the runner's --threads, PyTorch's --threads).
#   benches/attention-bench/run-rounds.sh rounds.jsonl 3
#   python3 benches/attention-bench/rounds.py rounds.jsonl     # min–max per cell, ratio ranges
# Needs: a release build (cargo build --release -p attention-bench) and PyTorch in ~/torch-venv.
set -uo pipefail
out=${1:-rounds.jsonl}
rounds=${2:-3}
root=$(cd "$(dirname "$0")/../.." && pwd)
runner=${RUNNER:-"$root/target/release/attention-bench"}
torch_py=${TORCH_PYTHON:-$HOME/torch-venv/bin/python}
peer="$root/../shared/peers/torch_mha.py"
shapes=${SHAPES:-"4x512x768x12 1x1024x768x12 1x2048x768x12"}
: > "$out"
tag() { sed "s/^{/{\"round\":$1,/"; }
for round in $(seq "$rounds"); do
  for threads in 1 2; do
    "$torch_py" "$peer" --sgemm 1024 --threads "$threads" --repeats 10 | tag "$round" >> "$out"
  done
  for mode in fwd fwdbwd; do
    for shape in $shapes; do
      for threads in 1 2; do
        "$torch_py" "$peer" --impl sdpa --mode $mode --threads "$threads" --repeats 5 --shapes "$shape" | tag "$round" >> "$out"
        for backend in flex ndarray; do
          "$runner" --backend $backend --impl fused --mode $mode --threads "$threads" --repeats 5 \
            --warmup 1 --shape "$shape" | tag "$round" >> "$out"
        done
      done
    done
  done
  # Decode: one token after 1023 cached, batch 1 and 8 (PyTorch's script has no decode).
  for threads in 1 2; do
    for backend in flex ndarray; do
      "$runner" --backend $backend --impl fused --mode decode --threads "$threads" --repeats 20 \
        --warmup 3 --shape 1x1024x768x12 --shape 8x1024x768x12 | tag "$round" >> "$out"
    done
  done
done
