"""The GPU kernel's targets from run-gpu.sh's output: per row, ours against Burn's op and PyTorch's
SDPA measured in the same round (ratios per round, their range), and met or missed.

    python3 benches/attention-bench/gpu_targets.py gpu.jsonl

Targets (the GPU-speed issue): the core and the layer, forward and forward+backward, at most
1.0x Burn's op at every shape (must); decoding at most Burn's op (must); 3 key/value heads at
most 1.0x all 12, a 512-key window at most 0.2x the full core (must); the core at most 2x SDPA
from T = 1024 (goal).

Packed documents (run-gpu.sh's `packed_set` rows): ours on the row packed from its documents
against the same row as one document, per round; no target, and beside it the share of the
causal row's score pairs that the documents keep.

Paged decoding (run-gpu.sh's `paged_set` rows): ours over a page pool against the same rows in a
dense cache, per round; targets as on the CPU (the paged-cache issue): rows at their own lengths
at most 0.4x the padded dense step, equal lengths at most 1.1x.

Caches in fewer bytes (run-gpu.sh's `kv_set` rows; the int8/f16 caches issue): a decoding step
over an f16 and an int8 cache against the f32 cache, per shape, dense and paged, per round; no
GPU target (the CPU's are int8 at most 0.5x, f16 at most 0.7x); and whole models decoding over an
int8 cache against f32, one run.

Whole models (the whole-models issue), per model and batch: decoding at least 5x the rate of the
first H200 run and faster than this project's 2-core CPU decoding (must); prefill at most 2x
transformers' time in float32 (must); decoding at least 1.0x transformers' tokens/s and prefill at
most 1.0x its time, f32 against float32 and f16 against bfloat16 (goal).

Continuous batching (run-gpu.sh's `workload_set` rows; the continuous-batching issue): our
engine's tokens/s on workload (a) at least 1.5x our static batches' and 2x transformers'
continuous batching, one run each.
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


# Decoding tokens/s before this round on the H200 (lm-bench --backend wgpu, f32, 64 new tokens),
# and this project's best 2-core CPU decoding (BENCHMARKS.md's whole-model tables).
FIRST_GPU_RUN = {("gpt2", 1): 21.1, ("gpt2", 8): 150, ("smollm2", 1): 9.2, ("smollm2", 8): 61.5}
CPU_DECODE = {("gpt2", 1): 52.6, ("gpt2", 8): 273, ("smollm2", 1): 43, ("smollm2", 8): 222}


def model_rows(rows):
    """The whole-model targets: (row, target, measured, verdict) per model, batch and dtype."""
    ours, theirs = {}, {}
    for r in rows:
        if "model" not in r or "decode_tokens_per_s" not in r:
            continue
        # Ours over a narrower cache is compared in kv_rows.
        if r.get("kv_dtype", "f32") != "f32":
            continue
        if r.get("impl") == "ours":
            ours[(r["model"], r["batch"], r.get("dtype", "f32"))] = r
        elif r.get("impl") == "transformers":
            dtype = {"float32": "f32", "bfloat16": "f16"}.get(r.get("dtype"), r.get("dtype"))
            theirs[(r["model"], r["batch"], dtype)] = r
    table = []
    for key in sorted(ours):
        model, batch, dtype = key
        mine, peer = ours[key], theirs.get(key)
        rate = mine["decode_tokens_per_s"]
        what = f"{model} batch {batch} {dtype}"
        if dtype == "f32" and (model, batch) in FIRST_GPU_RUN:
            first, cpu = FIRST_GPU_RUN[(model, batch)], CPU_DECODE[(model, batch)]
            table.append((f"{what}: decode tokens/s", f"≥ 5× {first} and > CPU {cpu}",
                          f"{rate:.1f} (×{rate / first:.1f})",
                          "met" if rate >= 5 * first and rate > cpu else "missed"))
        if peer is None:
            continue
        speed = rate / peer["decode_tokens_per_s"]
        table.append((f"{what}: decode, ours / transformers", "≥ 1.0 (goal)",
                      f"×{speed:.2f} ({rate:.1f} / {peer['decode_tokens_per_s']:.1f})",
                      "met" if speed >= 1.0 else "missed"))
        prefill = mine["prefill_ms"] / peer["prefill_ms"]
        limit = 2.0 if dtype == "f32" else 1.0
        table.append((f"{what}: prefill, ours / transformers",
                      "≤ 2.0, ≤ 1.0 goal" if dtype == "f32" else "≤ 1.0 (goal)",
                      f"×{prefill:.2f} ({mine['prefill_ms']:.1f} / {peer['prefill_ms']:.1f} ms)",
                      ("met" if prefill <= 1.0 else "must met, goal missed" if prefill <= limit
                       else "missed")))
        for counter in ("syncs_per_token", "compiles_in_steady_state"):
            if counter in mine:
                table.append((f"{what}: {counter}", "≤ 1" if counter.startswith("syncs") else "0",
                              f"{mine[counter]:g}",
                              "met" if mine[counter] <= (1 if counter.startswith("syncs") else 0)
                              else "missed"))
    return table


def packed_rows(rows, ratios):
    """Ours packed / ours as one document, per (core, mode, shape) and round."""
    # (core, mode, shape, document lengths, or () for one document) -> {round: median ms}
    times = collections.defaultdict(dict)
    for r in rows:
        if "packed_set" in r and r.get("impl") == "fused" and "median_ms" in r:
            key = (r.get("core", False), r["mode"], r["shape"], tuple(r.get("documents") or ()))
            times[key][r.get("round", 1)] = r["median_ms"]
    table = []
    for (core, mode, shape, lengths), packed in sorted(times.items()):
        whole = times.get((core, mode, shape, ()))
        if not lengths or not whole:
            continue
        seq = int(shape.split("x")[1])
        # A causal document of L tokens scores L (L + 1) / 2 pairs.
        kept = sum(n * (n + 1) for n in lengths) / (seq * (seq + 1))
        values = ratios(packed, whole)
        table.append((f"{'core' if core else 'layer'} {mode} {shape}: {len(lengths)} documents / one",
                      f"— (pairs kept ×{kept:.3f})", f"×{span(values)}", ""))
    return table


def paged_rows(rows, ratios):
    """Ours paged / ours dense, per (set, shape, lengths) and round."""
    # (set, shape, lengths, cache) -> {round: median ms}
    times = collections.defaultdict(dict)
    for r in rows:
        if "paged_set" in r and "median_ms" in r:
            key = (r["paged_set"], r["shape"], tuple(r.get("lengths") or ()), r.get("cache"))
            times[key][r.get("round", 1)] = r["median_ms"]
    table = []
    for (kind, shape, lengths, cache), paged in sorted(times.items()):
        dense = times.get((kind, shape, lengths, "dense"))
        if cache != "paged" or not dense:
            continue
        bound = 0.4 if kind == "ragged" else 1.1
        values = ratios(paged, dense)
        table.append((f"decode {shape} {kind}: paged / dense", f"≤ {bound}", f"×{span(values)}",
                      verdict(values, lambda v: v <= bound)))
    return table


def kv_rows(rows, ratios):
    """Caches in fewer bytes (run-gpu.sh's `kv_set` rows, and lm-bench over an int8 cache): each
    narrow type's decoding step against the f32 cache's, per round; no GPU target."""
    # (cache, shape, kv_dtype) -> {round: median ms}
    times = collections.defaultdict(dict)
    models = {}
    for r in rows:
        if "kv_set" in r and "median_ms" in r:
            times[(r["kv_set"], r["shape"], r.get("kv_dtype", "f32"))][r.get("round", 1)] = r["median_ms"]
        if "model" in r and r.get("impl") == "ours" and "decode_tokens_per_s" in r:
            models[(r["model"], r["batch"], r.get("dtype", "f32"), r.get("kv_dtype", "f32"))] = r
    table = []
    for (cache, shape, kv_dtype), narrow in sorted(times.items()):
        full = times.get((cache, shape, "f32"))
        if kv_dtype == "f32" or not full:
            continue
        values = ratios(narrow, full)
        cpu = 0.5 if kv_dtype == "int8" else 0.7
        table.append((f"decode {shape} {cache}: {kv_dtype} / f32 cache", f"none (CPU: ≤ {cpu})",
                      f"×{span(values)}", "measured" if values else "not measured"))
    for (model, batch, dtype, kv_dtype), mine in sorted(models.items()):
        full = models.get((model, batch, dtype, "f32"))
        if kv_dtype == "f32" or not full:
            continue
        rate, base = mine["decode_tokens_per_s"], full["decode_tokens_per_s"]
        table.append((f"{model} batch {batch} {dtype}: decode over {kv_dtype} / f32 cache",
                      "none (CPU: ≥ 1.5 at batch 8)", f"×{rate / base:.2f} ({rate:.1f} / {base:.1f})",
                      "measured"))
    return table


def workload_rows(rows):
    """Continuous batching (run-gpu.sh's `workload_set` rows): our engine's tokens/s against our
    static batches and against transformers' continuous batching, one run each."""
    runs = {}
    for r in rows:
        if "workload_set" in r and "tokens_per_s" in r:
            runs[(r["workload_set"], r["impl"], r["mode"])] = r["tokens_per_s"]
    table = []
    for family in sorted({key[0] for key in runs}):
        engine = runs.get((family, "ours", "continuous"))
        if engine is None:
            continue
        for who, mode, bound in (("ours", "static", 1.5), ("transformers", "continuous", 2.0)):
            theirs = runs.get((family, who, mode))
            if theirs is None:
                continue
            value = engine / theirs
            table.append((f"workload {family}: engine / {who} {mode} tokens/s", f"≥ {bound}",
                          f"×{value:.2f} ({engine:.0f} / {theirs:.0f})", verdict([value], lambda v: v >= bound)))
    return table


def main(path):
    rows = [json.loads(line) for line in open(path) if line.startswith("{")]
    # (core, mode, shape, kv_heads, window, dtype, who) -> {round: median ms}
    times = collections.defaultdict(dict)
    for r in rows:
        if "median_ms" not in r or "impl" not in r:
            continue
        # Packed rows, and the unpacked rows timed beside them, are compared in packed_rows.
        if "packed_set" in r or r.get("documents") or "paged_set" in r or "kv_set" in r:
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
    table += packed_rows(rows, ratios)
    table += paged_rows(rows, ratios)
    table += kv_rows(rows, ratios)
    table += model_rows(rows)
    table += workload_rows(rows)
    gpu = next((r["gpu"] for r in rows if r.get("kind") == "gpu"), "no GPU named")
    print(f"GPU: {gpu}\n")
    print("| row | target | measured (range over rounds) | |")
    print("|---|---|---|---|")
    for row in table:
        print("| " + " | ".join(row) + " |")
    for r in rows:
        if "failed" in r or "skipped" in r:
            why = r.get("stderr") or r.get("reason") or ("timed out" if r.get("rc") == 124 else f"rc {r.get('rc')}")
            print(f"\n- {r.get('failed') or r.get('skipped')}: {why}")


if __name__ == "__main__":
    main(sys.argv[1])
