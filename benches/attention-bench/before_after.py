"""The table of a same-run before/after (run-before-after-ours.sh): per row, each side's range over
the rounds and the per-round after / before ratio (its range and median). A time's ratio above 1 is
slower; a rate's (tokens/s) above 1 is faster.

    python3 benches/attention-bench/before_after.py out.jsonl
"""
import collections
import json
import statistics
import sys

rows = collections.OrderedDict()
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "side" not in r:
        continue
    if "model" in r:
        cells = [(f"{r['model']} batch {r['batch']} prefill (ms)", r["prefill_ms"])]
        # A prefill-only run (a token or two) has no decoding rate to speak of.
        if r["new"] >= 8:
            cells.append((f"{r['model']} batch {r['batch']} decode (tokens/s)", r["decode_tokens_per_s"]))
    else:
        threads = f"{r['threads']} thread{'s' if r['threads'] > 1 else ''}"
        cells = [(f"layer {r['mode']} {r['shape']}, {threads} (ms)", r["median_ms"])]
    for name, value in cells:
        rows.setdefault(name, {"before": {}, "after": {}})[r["side"]][(r.get("focus"), r["round"])] = value
print("| row | before | after | after / before per round (median) |")
print("|---|---|---|---|")
for name, sides in rows.items():
    before, after = sides["before"], sides["after"]
    ratios = [after[k] / before[k] for k in before if k in after]
    span = lambda values: f"{min(values):.4g}–{max(values):.4g}"
    print(f"| {name} | {span(before.values())} | {span(after.values())} | "
          f"×{min(ratios):.2f}–{max(ratios):.2f} ({statistics.median(ratios):.2f}) |")
