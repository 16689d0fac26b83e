#!/usr/bin/env bash
# Same-run before/after of a change: run-rounds.sh (ours and PyTorch at 1 and 2 threads) and
# lm-bench on whole checkpoints, for two release builds, alternating round by round so that
# drift on a shared machine hits both alike.
#   benches/attention-bench/run-before-after.sh BEFORE_BIN_DIR AFTER_BIN_DIR out-prefix [rounds] [model dir ...]
#   python3 benches/attention-bench/rounds.py out-prefix-before.jsonl   # and -after.jsonl
# BIN_DIR holds attention-bench and lm-bench (target/release of each tree, after
# `cargo build --release -p attention-bench -p lm-bench`). Model directories as
# save_pretrained writes them (peer_lm.py --save for GPT-2 small).
set -uo pipefail
before=$1 after=$2 out=$3 rounds=${4:-2}
shift 4 2>/dev/null || shift $#
models=("$@")
here=$(cd "$(dirname "$0")" && pwd)
: > "$out-before.jsonl"; : > "$out-after.jsonl"; : > "$out-lm.jsonl"
for round in $(seq "$rounds"); do
  for side in before after; do
    dir=$before; [ "$side" = after ] && dir=$after
    RUNNER="$dir/attention-bench" "$here/run-rounds.sh" "$out-$side.round" 1
    sed "s/^{\"round\":1,/{\"round\":$round,/" "$out-$side.round" >> "$out-$side.jsonl"
    for model in "${models[@]}"; do
      "$dir/lm-bench" --model "$model" --backend flex --batch 1 --batch 8 --new ${NEW_TOKENS:-32} --repeats ${LM_REPEATS:-2} --threads 2 \
        | sed "s|^{|{\"side\":\"$side\",\"round\":$round,\"model\":\"$(basename "$model")\",|" >> "$out-lm.jsonl"
    done
  done
done
rm -f "$out-before.round" "$out-after.round"
