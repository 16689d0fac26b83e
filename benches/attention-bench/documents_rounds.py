"""Tables of run-documents.sh's output: per case (the packed row, the same row as one document,
the documents padded into a batch), the min–max of the per-round medians, and the ratios
packed / one document and packed / padded, each from one round, with their range over rounds.

    python3 benches/attention-bench/documents_rounds.py documents.jsonl
"""
import collections
import json
import sys

CASES = ("packed", "one document", "padded")

rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
cells = collections.defaultdict(dict)  # (mode, core, case) -> {round: median_ms}
shapes, threads, lengths = {}, set(), None
for r in rows:
    cells[(r["mode"], r["core"], r["case"])][r["round"]] = r["median_ms"]
    shapes[r["case"]] = r["shape"]
    threads.add(r["threads"])
    lengths = r.get("documents") or lengths


def span(values, fmt="{:.3g}"):
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"


def ratios(mine, theirs):
    """Per round where both ran: mine / theirs."""
    return [mine[k] / theirs[k] for k in sorted(mine) if k in theirs]


if lengths:
    seq = sum(lengths)
    # A causal document of L tokens scores L (L + 1) / 2 pairs.
    kept = sum(n * (n + 1) for n in lengths) / (seq * (seq + 1))
    print(f"- {len(lengths)} documents of {min(lengths)} to {max(lengths)} tokens in a row of "
          f"{seq}: the causal row's score pairs they keep ×{kept:.3f}")
print("- shapes: " + ", ".join(f"{case} {shapes[case]}" for case in CASES if case in shapes))
print(f"- threads: {', '.join(map(str, sorted(threads)))}")
for mode in sorted({k[0] for k in cells}):
    print(f"\n### `{mode}` (ms, min–max of round medians; ratios per round, their range)\n")
    print("| | " + " | ".join(CASES) + " | packed / one document | packed / padded |")
    print("|---" * (len(CASES) + 3) + "|")
    for core in (True, False):
        times = [cells.get((mode, core, case), {}) for case in CASES]
        if not any(times):
            continue
        text = [span(list(t.values())) if t else "–" for t in times]
        for other in times[1:]:
            values = ratios(times[0], other)
            text.append(f"×{span(values, '{:.2f}')}" if values else "–")
        print(f"| {'core' if core else 'layer'} | " + " | ".join(text) + " |")
