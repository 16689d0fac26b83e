#!/usr/bin/env bash
# Every row of the CPU-speed targets (BENCHMARKS.md, "The CPU targets on one machine"), measured
# on the machine it runs on: the machine's name and flags, its memcpy and read rates, the prefills'
# projections against torch's linear, the layer against
# PyTorch's sdpa at 1 and 2 threads (run-rounds.sh at 1x1024x768x12), decoding after 1023 and
# 16 383 cached positions, and GPT-2 small and a SmolLM2-135M-shaped Llama against transformers;
# ours and the peers back to back, all of it once per round.
#   benches/attention-bench/run-targets.sh OUT.jsonl ROUNDS GPT2_DIR SMOLLM2_DIR
#   python3 benches/attention-bench/targets.py OUT.jsonl
# Needs: cargo build --release -p attention-bench -p lm-bench; PyTorch and transformers in
# ~/torch-venv (shared/peers/README.md); the directories from peer_lm.py --family gpt2 / smollm2
# --save DIR.
set -uo pipefail
out=$1 rounds=$2 gpt2=$3 smollm2=$4
here=$(cd "$(dirname "$0")" && pwd)
bin=${BIN_DIR:-"$here/../../target/release"}
torch_py=${TORCH_PYTHON:-$HOME/torch-venv/bin/python}
tag() { sed "s/^{/{\"round\":$1,/"; }
# A prefill's products (128 and 1024 rows): GPT-2 small's q/k/v, output, MLP in and out, then
# SmolLM2-135M's q/k/v, output, gate/up as one, down.
products=""
for rows in 1x128 8x128; do
  for io in 768x2304 768x768 768x3072 3072x768 576x960 576x576 576x3072 1536x576; do
    products="$products --shape ${rows}x$io"
  done
done
lscpu | python3 -c '
import json, sys
info = dict(line.split(":", 1) for line in sys.stdin if ":" in line)
flags = info.get("Flags", "").split()
print(json.dumps({"kind": "machine", "model_name": info.get("Model name", "?").strip(),
                  "cpus": int(info.get("CPU(s)", "0")),
                  "avx512": " ".join(f for f in flags if f.startswith("avx512"))}))' > "$out"
for model in "$gpt2" "$smollm2"; do
  python3 "$here/targets.py" --weights "$model" >> "$out"
done
for round in $(seq "$rounds"); do
  "$bin/memcpy-rate" --threads 1 --threads 2 | tag "$round" >> "$out"
  # shellcheck disable=SC2086
  # Its own `"round":1` gives way to this round's.
  "$bin/linear-grad-rate" --backend flex --forward-only --threads 2 --rounds 1 --repeats 7 \
    $products | sed 's/"round":1,//' | tag "$round" >> "$out"
  # shellcheck disable=SC2086
  "$torch_py" "$here/peer_linear.py" --threads 2 --repeats 7 $products | tag "$round" >> "$out"
  SHAPES=1x1024x768x12 RUNNER="$bin/attention-bench" "$here/run-rounds.sh" "$out.round" 1
  sed "s/^{\"round\":1,/{\"round\":$round,/" "$out.round" >> "$out"
  for threads in 1 2; do
    for backend in flex ndarray; do
      "$bin/attention-bench" --backend $backend --impl fused --mode decode --threads $threads \
        --repeats 10 --warmup 2 --shape 1x16384x768x12 | tag "$round" >> "$out"
    done
  done
  for model in "$gpt2" "$smollm2"; do
    name=$(basename "$model")
    "$bin/lm-bench" --model "$model" --backend flex --batch 1 --batch 8 --prompt 128 --new 32 \
      --repeats 2 --threads 2 | sed "s|^{|{\"round\":$round,\"model\":\"$name\",|" >> "$out"
    "$torch_py" "$here/peer_lm.py" --model "$model" --batch 1,8 --prompt 128 --new 32 \
      --repeats 2 --threads 2 | sed "s|^{|{\"round\":$round,\"model\":\"$name\",|" >> "$out"
  done
done
rm -f "$out.round"
