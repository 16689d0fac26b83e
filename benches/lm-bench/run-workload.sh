#!/usr/bin/env bash
# Workload (a) through our engine (and our static batches, which lm-bench times in the same call)
# and through transformers' continuous batching, interleaved round by round, on the CPU: the
# figures of BENCHMARKS.md's "Continuous batching". Each MODELS entry is a save_pretrained
# directory; lm-bench's line carries our engine's settings, peer_lm.py's the peer's.
#   benches/lm-bench/run-workload.sh OUT.jsonl
# Environment: MODELS ("/tmp/gpt2-small /tmp/smollm2-135m"; make them with
#   peer_lm.py --family gpt2|smollm2 --save DIR), ROUNDS (3), WORKLOAD (a-mixed.jsonl),
#   TORCH_PYTHON (python3), THREADS (2), EXTRA_CAPS (engine runs with these
#   --prefill-while-decoding values besides the default, e.g. "512").
set -euo pipefail
out=$1
here=$(cd "$(dirname "$0")" && pwd)
bin=${BIN_DIR:-$here/../../target/release}
py=${TORCH_PYTHON:-python3}
models=${MODELS:-/tmp/gpt2-small /tmp/smollm2-135m}
rounds=${ROUNDS:-3}
workload=${WORKLOAD:-$here/workloads/a-mixed.jsonl}
threads=${THREADS:-2}
extra_caps=${EXTRA_CAPS:-}
lscpu | grep -m1 "Model name" | sed 's/.*: *//; s/^/{"kind":"machine","cpu":"/; s/$/"}/' >> "$out"
for round in $(seq "$rounds"); do
  for model in $models; do
    tag="{\"round\":$round,\"model\":\"$(basename "$model")\","
    "$bin/lm-bench" --model "$model" --workload "$workload" --threads "$threads" |
      sed "s/^{/$tag/" >> "$out"
    "$py" "$here/../attention-bench/peer_lm.py" --model "$model" --workload "$workload" \
      --threads "$threads" 2>/dev/null | sed "s/^{/$tag/" >> "$out"
    for cap in $extra_caps; do
      "$bin/lm-bench" --model "$model" --workload "$workload" --threads "$threads" \
        --prefill-while-decoding "$cap" | grep '"continuous"' | sed "s/^{/$tag/" >> "$out"
    done
  done
done
