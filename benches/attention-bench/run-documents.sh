#!/usr/bin/env bash
# Packed documents on the CPU: our fused path on burn-flex, every pool THREADS wide, width 768 and
# 12 heads, forward and backward, in interleaved rounds (drift on a shared machine lasts minutes),
# each round timing, for the attention core alone (--core) and for the whole layer:
#   packed        the 4096-token row packed from the 16 documents of documents-4096x16.txt;
#   one document  the same row as one causal document;
#   padded        the same 16 documents padded into a 16 x 512 batch. The runner has no key
#                 padding, so each row is timed as 512 tokens of one causal document: what a
#                 padded batch costs where nothing skips its padding (and with right padding under
#                 a causal mask, no real token sees a padded key, so key padding would change no
#                 real token's output).
# Then documents_rounds.py prints each case's range and the ratios packed / one document and
# packed / padded, each from one round, with their range over rounds.
#   benches/attention-bench/run-documents.sh documents.jsonl 5
#   python3 benches/attention-bench/documents_rounds.py documents.jsonl   # again, from the file
# Needs a release build (cargo build --release -p attention-bench).
set -uo pipefail
out=${1:-documents.jsonl}
rounds=${2:-5}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
runner=${RUNNER:-"$root/target/release/attention-bench"}
threads=${THREADS:-2}
repeats=${REPEATS:-5}
modes=${MODES:-fwdbwd}
documents=$(grep -v '^#' "$here/documents-4096x16.txt" | tr -d ' \n')
: > "$out"
# Tags a line with its round and case.
tag() { sed "s/^{/{\"round\":$1,\"case\":\"$2\",/"; }
bench() {
  "$runner" --backend flex --impl fused --threads "$threads" --repeats "$repeats" --warmup 1 "$@"
}
for round in $(seq "$rounds"); do
  for mode in $modes; do
    for core in --core ""; do
      bench --mode "$mode" $core --shape 1x4096x768x12 --documents "$documents" |
        tag "$round" packed >> "$out"
      bench --mode "$mode" $core --shape 1x4096x768x12 | tag "$round" "one document" >> "$out"
      bench --mode "$mode" $core --shape 16x512x768x12 | tag "$round" padded >> "$out"
    done
  done
done
python3 "$here/documents_rounds.py" "$out"
