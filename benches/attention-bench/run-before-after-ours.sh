#!/usr/bin/env bash
# A change's same-run check, ours only (no PyTorch): the layer's forward, forward + backward and
# decoding rows on flex and lm-bench on whole checkpoints, for two release builds alternated
# round by round, so that drift on a shared machine hits both alike.
#   benches/attention-bench/run-before-after-ours.sh BEFORE_BIN_DIR AFTER_BIN_DIR out.jsonl [rounds] [model dir ...]
#   python3 benches/attention-bench/before_after.py out.jsonl
# BIN_DIR holds attention-bench and lm-bench (target/release of each tree, after
# `cargo build --release -p attention-bench -p lm-bench`); model directories as
# `peer_lm.py --family gpt2|smollm2 --save DIR` writes them.
set -uo pipefail
before=$1 after=$2 out=$3 rounds=${4:-3}
shift 4 2>/dev/null || shift $#
models=("$@")
: > "$out"
for round in $(seq "$rounds"); do
  for side in before after; do
    dir=$before; [ "$side" = after ] && dir=$after
    tag() { sed "s|^{|{\"side\":\"$side\",\"round\":$round,$1|"; }
    for mode in fwd fwdbwd; do
      for threads in 1 2; do
        "$dir/attention-bench" --backend flex --impl fused --mode $mode --threads $threads --repeats 5 \
          --warmup 1 --shape 1x1024x768x12 | tag >> "$out"
      done
    done
    "$dir/attention-bench" --backend flex --impl fused --mode decode --threads 2 --repeats 100 \
      --warmup 10 --shape 1x1024x768x12 --shape 8x1024x768x12 | tag >> "$out"
    for model in "${models[@]}"; do
      "$dir/lm-bench" --model "$model" --backend flex --batch 1 --batch 8 --new 32 --repeats 2 --threads 2 \
        | tag "\"model\":\"$(basename "$model")\"," >> "$out"
    done
  done
done
