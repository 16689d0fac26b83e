#!/usr/bin/env bash
# tiny-gpt trained on documents packed into rows against the same documents one per row
# (right-padded, padding labels ignored), at about equal real tokens, for seeds 0 1 2, the two
# runs of a seed back to back. Packed rows hold 64 real tokens, one-per-row rows 43.75 on average
# (the training text's 180 009 tokens in 2 813 and 4 114 rows of 64): 600 steps against 878.
# Each run prints its real tokens, tokens/s and `final: val_loss=…` (each validation document
# scored on its own).
#   cargo build --release -p tiny-gpt && examples/tiny-gpt/run-packed-seeds.sh > packed-seeds.txt
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
tiny=${TINY_GPT:-"$root/target/release/tiny-gpt"}
out=${OUT_DIR:-$(mktemp -d)}
for seed in ${SEEDS:-0 1 2}; do
  for layout in pack one; do
    if [ "$layout" = pack ]; then flags=(--pack --steps 600); else flags=(--one-document-per-row --steps 878); fi
    echo "== seed $seed $layout"
    "$tiny" train "${flags[@]}" --seed "$seed" --out "$out/$layout-$seed" 2>&1 |
      grep -E "documents of|steps in|final"
  done
done
