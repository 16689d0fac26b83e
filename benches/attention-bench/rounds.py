"""Tables of run-rounds.sh's output: per cell, min–max of the per-round medians, and the range of
ours / PyTorch sdpa ratios over rounds (each ratio from the same round).

    python3 benches/attention-bench/rounds.py rounds.jsonl
"""
import collections
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
cells = collections.defaultdict(dict)  # (mode, threads, shape, who) -> {round: median_ms}
sgemm = collections.defaultdict(list)  # threads -> GFLOP/s per round
for r in rows:
    if r.get("kind") == "sgemm":
        if r["lib"] == "torch.mm":
            sgemm[r["threads"]].append(r["gflops_median"])
        continue
    who = "sdpa" if r.get("kind") == "attn" else f"{r['backend']} fused"
    cells[(r["mode"], r["threads"], r["shape"], who)][r["round"]] = r["median_ms"]

def span(values, fmt="{:.3g}"):
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"

for threads, rates in sorted(sgemm.items()):
    print(f"- torch.mm sgemm n=1024, {threads} thread(s): {span(rates, '{:.0f}')} GFLOP/s")
for mode in ("fwd", "fwdbwd", "decode"):
    for threads in (1, 2):
        keys = [k for k in cells if k[0] == mode and k[1] == threads]
        if not keys:
            continue
        shapes = sorted({k[2] for k in keys}, key=lambda s: [int(x) for x in s.split("x")])
        whos = sorted({k[3] for k in keys}, key=lambda w: (w == "sdpa", w))
        print(f"\n### `{mode}`, {threads} thread{'s' if threads > 1 else ''} (ms, min–max of round medians; ratio to sdpa per round)\n")
        print("| | " + " | ".join(shapes) + " |")
        print("|---" * (len(shapes) + 1) + "|")
        for who in whos:
            out = []
            for shape in shapes:
                mine = cells.get((mode, threads, shape, who))
                if not mine:
                    out.append("–")
                    continue
                text = span(list(mine.values()))
                ref = cells.get((mode, threads, shape, "sdpa"), {})
                ratios = [mine[r] / ref[r] for r in mine if r in ref]
                if who != "sdpa" and ratios:
                    text += f" (×{span(ratios, '{:.2f}')})"
                out.append(text)
            print(f"| {who} | " + " | ".join(out) + " |")
