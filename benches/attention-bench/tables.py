#!/usr/bin/env python3
"""Markdown tables for BENCHMARKS.md from the JSON lines of run-all.sh.

    python3 benches/attention-bench/tables.py results.jsonl > tables.md

One table per mode: every (backend, impl) of ours and PyTorch's ref/sdpa at each shape, median ms,
GFLOP/s, peak RSS, and the ratio to PyTorch sdpa measured in the same run (decode has no PyTorch
peer). Plus the matmul ceiling (torch --sgemm)."""
import json
import sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
shapes = ["1x6x4x2", "8x128x256x4", "4x512x768x12", "1x1024x768x12", "1x2048x768x12"]

print("Matmul ceiling (float32 NxN @ NxN, 2 threads, median):\n")
for r in rows:
    if r.get("kind") == "sgemm":
        print(f"- {r['lib']} n={r['n']}: {r['gflops_median']} GFLOP/s")
print()

for mode in ["fwd", "fwdbwd", "decode"]:
    sdpa = {r["shape"]: r["median_ms"] for r in rows if r.get("kind") == "attn" and r["impl"] == "sdpa" and r["mode"] == mode}
    ours = [r for r in rows if "backend" in r and r.get("mode") == mode and "median_ms" in r]
    peers = [r for r in rows if r.get("kind") == "attn" and r["mode"] == mode]
    names = sorted({(r["backend"], r["impl"]) for r in ours}) + sorted({("pytorch", r["impl"]) for r in peers})
    if not names:
        continue
    print(f"### `{mode}`\n")
    print("| backend / impl | " + " | ".join(shapes) + " |")
    print("|---|" + "---|" * len(shapes))
    for backend, impl in names:
        cells = []
        for shape in shapes:
            match = [r for r in (ours if backend != "pytorch" else peers)
                     if r.get("shape") == shape and r["impl"] == impl and r.get("backend", "pytorch") == backend]
            if not match:
                cells.append("–")
                continue
            r = match[0]
            cell = f"{r['median_ms']:.3g} ms"
            if shape in sdpa and mode != "decode":
                cell += f" (×{r['median_ms'] / sdpa[shape]:.2f})"
            rss = r.get("peak_rss_mib")
            if rss is not None and backend != "pytorch":
                cell += f", {rss:.0f} MiB"
            cells.append(cell)
        print(f"| {backend} / {impl} | " + " | ".join(cells) + " |")
    print()
    failed = [r for r in rows if "error" in r and r.get("mode") == mode]
    for r in failed:
        print(f"- {r['backend']} / {r['impl']}: {r['error']}")
    if failed:
        print()
for r in rows:
    if "backend" in r and r.get("shape") in ("1x16384x768x12", "1x4096x768x12"):
        print(f"- long context: {r['backend']} / {r['impl']} / {r['mode']} at {r['shape']}: "
              f"{r['median_ms']:.0f} ms, peak RSS {r['peak_rss_mib']:.0f} MiB")
