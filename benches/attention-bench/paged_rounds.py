"""Tables of run-paged.sh's output: each case's min–max of the per-round medians (ms), the
cache's bytes, and the ratios paged / dense (and after / before), each from one round, with their
range over rounds.

    python3 benches/attention-bench/paged_rounds.py paged.jsonl
"""
import collections
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
times = collections.defaultdict(dict)  # key -> {round: median_ms}
bytes_of = {}
threads = set()
for r in rows:
    key = (r["case"], r["build"], r["mode"], r["shape"], r.get("cache") or "dense", r.get("page_size"))
    times[key][r["round"]] = r["median_ms"]
    bytes_of[key] = r.get("cache_bytes")
    threads.add(r["threads"])


def span(values, fmt="{:.3g}"):
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"


def ratios(mine, theirs):
    """Per round where both ran: mine / theirs."""
    return [mine[k] / theirs[k] for k in sorted(mine) if k in theirs]


def mib(n):
    return "–" if n is None else f"{n / 2**20:.1f}"


print(f"- threads: {', '.join(map(str, sorted(threads)))}; {len({r['round'] for r in rows})} rounds")
print("\n| case | shape | paged ms | dense ms | paged / dense | paged MiB | dense MiB |")
print("|---|---|---|---|---|---|---|")
for (case, build, mode, shape, cache, page), paged in sorted(times.items()):
    if cache != "paged" or case not in ("ragged", "equal"):
        continue
    dense_key = (case, build, mode, shape, "dense", None)
    dense = times.get(dense_key, {})
    text = [case, f"{shape}, pages of {page}", span(list(paged.values()))]
    text.append(span(list(dense.values())) if dense else "–")
    values = ratios(paged, dense)
    text.append(f"×{span(values, '{:.2f}')}" if values else "–")
    text += [mib(bytes_of[(case, build, mode, shape, cache, page)]), mib(bytes_of.get(dense_key))]
    print("| " + " | ".join(text) + " |")
sizes = sorted((k for k in times if k[0].startswith("pages-")), key=lambda k: k[5])
if sizes:
    print("\n| page size | ms | MiB | / pages of 128 |")
    print("|---|---|---|---|")
    base = next((times[k] for k in sizes if k[5] == 128), None)
    for key in sizes:
        values = ratios(times[key], base) if base else []
        ratio = f"×{span(values, '{:.2f}')}" if values else "–"
        print(f"| {key[5]} | {span(list(times[key].values()))} | {mib(bytes_of[key])} | {ratio} |")
pairs = sorted({k[2:4] for k in times if k[0] == "before"})
if pairs:
    print("\n| mode | shape | before ms | after ms | after / before |")
    print("|---|---|---|---|---|")
    for mode, shape in pairs:
        before = times.get(("before", "before", mode, shape, "dense", None), {})
        after = times.get(("before", "after", mode, shape, "dense", None), {})
        values = ratios(after, before)
        ratio = f"×{span(values, '{:.2f}')}" if values else "–"
        print(f"| {mode} | {shape} | {span(list(before.values()))} | {span(list(after.values()))} | {ratio} |")
