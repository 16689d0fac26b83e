"""The GPU kernel's targets from run-gpu.sh's output: per row, ours against Burn's op and PyTorch's
SDPA measured in the same round (ratios per round, their range), and met or missed.

    python3 benches/attention-bench/gpu_targets.py gpu.jsonl

Targets (the GPU-speed issue): the core and the layer, forward and forward+backward, at most
1.0x Burn's op at every shape (must); decoding at most Burn's op (must); 3 key/value heads at
most 1.0x all 12, a 512-key window at most 0.2x the full core (must); the core at most 2x SDPA
from T = 1024 (goal).
"""
import collections
import json
import sys


def span(values, fmt="{:.2f}"):
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"


def verdict(values, ok):
    if not values:
        return "not measured"
    hits = sum(ok(v) for v in values)
    return "met" if hits == len(values) else ("missed" if hits == 0 else f"met in {hits} of {len(values)}")


def main(path):
    rows = [json.loads(line) for line in open(path) if line.startswith("{")]
    # (core, mode, shape, kv_heads, window, dtype, who) -> {round: median ms}
    times = collections.defaultdict(dict)
    for r in rows:
        if "median_ms" not in r:
            continue
        who = {"fused": "ours", "burn-op": "burn-op", "torch-sdpa": "sdpa"}[r["impl"]]
        heads = int(r["shape"].split("x")[3])
        key = (r.get("core", False), r["mode"], r["shape"], r.get("num_kv_heads") or heads,
               r.get("sliding_window"), r.get("dtype", "f32"), who)
        times[key][r.get("round", 1)] = r["median_ms"]

    def ratios(mine, theirs):
        return [mine[k] / theirs[k] for k in sorted(mine) if k in theirs]

    table = []
    shapes = sorted({k[2] for k in times}, key=lambda s: [int(d) for d in s.split("x")])
    for core in (True, False):
        for dtype in ("f32", "f16"):
            for mode in ("fwd", "fwdbwd", "decode"):
                for shape in shapes:
                    heads = int(shape.split("x")[3])
                    base = (core, mode, shape, heads, None, dtype)
                    ours = times.get(base + ("ours",))
                    if not ours:
                        continue
                    what = f"{'core' if core else 'layer'} {mode} {shape} {dtype}"
                    burn = ratios(ours, times.get(base + ("burn-op",), {}))
                    table.append((f"{what}: ours / Burn's op", "≤ 1.0",
                                  f"×{span(burn)}" if burn else "Burn's op did not run",
                                  verdict(burn, lambda v: v <= 1.0)))
                    seq = int(shape.split("x")[1])
                    sdpa = ratios(ours, times.get(base + ("sdpa",), {}))
                    if core and seq >= 1024 and sdpa:
                        table.append((f"{what}: ours / PyTorch SDPA", "≤ 2.0 (goal)",
                                      f"×{span(sdpa)} ({span(list(ours.values()), '{:.3g}')} ms)",
                                      verdict(sdpa, lambda v: v <= 2.0)))
    for mode in ("fwd", "fwdbwd"):
        for shape in shapes:
            heads = int(shape.split("x")[3])
            full = times.get((True, mode, shape, heads, None, "f32", "ours"))
            grouped = times.get((True, mode, shape, 3, None, "f32", "ours"))
            window = times.get((True, mode, shape, heads, 512, "f32", "ours"))
            if full and grouped:
                values = ratios(grouped, full)
                table.append((f"core {mode} {shape}: 3 kv heads / 12", "≤ 1.0", f"×{span(values)}",
                              verdict(values, lambda v: v <= 1.0)))
            if full and window:
                values = ratios(window, full)
                table.append((f"core {mode} {shape}: 512 window / full", "≤ 0.2", f"×{span(values)}",
                              verdict(values, lambda v: v <= 0.2)))
    gpu = next((r["gpu"] for r in rows if r.get("kind") == "gpu"), "no GPU named")
    print(f"GPU: {gpu}\n")
    print("| row | target | measured (range over rounds) | |")
    print("|---|---|---|---|")
    for row in table:
        print("| " + " | ".join(row) + " |")
    for r in rows:
        if "failed" in r or "skipped" in r:
            print(f"\n- {r.get('failed') or r.get('skipped')}: {r.get('stderr') or r.get('reason')}")


if __name__ == "__main__":
    main(sys.argv[1])
