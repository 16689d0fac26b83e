"""Each cache type's decoding step against the f32 cache's, from run-kv-dtypes.sh's lines: the
median's range over rounds, and the ratio to f32 in the same round (its range over rounds)."""

import json
import sys
from collections import defaultdict

lines = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
times = defaultdict(dict)  # (shape, cache, kv_dtype) -> round -> median ms
sizes = {}
for line in lines:
    key = (line["shape"], line["cache"], line["kv_dtype"])
    times[key][line["round"]] = line["median_ms"]
    sizes[key] = line["cache_bytes"]
print("shape            cache  kv     median ms (range)   ratio to f32 (range)   cache MiB")
for (shape, cache, kv), rounds in sorted(times.items()):
    base = times[(shape, cache, "f32")]
    ratios = sorted(rounds[r] / base[r] for r in rounds if r in base)
    medians = sorted(rounds.values())
    print(
        f"{shape:16} {cache:6} {kv:5} {medians[len(medians) // 2]:7.2f} "
        f"({medians[0]:.2f}–{medians[-1]:.2f})   {ratios[len(ratios) // 2]:.2f} "
        f"({ratios[0]:.2f}–{ratios[-1]:.2f})        {sizes[(shape, cache, kv)] / 2**20:.1f}"
    )
