"""The CPU-speed targets table from run-targets.sh's output: for every row, the measured range over
rounds (each ratio from one round, ours and the peer back to back) and whether it meets the target.

    python3 benches/attention-bench/targets.py OUT.jsonl          # the markdown table
    python3 benches/attention-bench/targets.py --weights MODEL_DIR  # one JSON line (run-targets.sh)

A decoding step reads every weight matrix once (the tied or separate head included) and one row
of the embeddings: `--weights` counts those bytes from the directory's config.json (float32). The
streaming limit is memcpy-rate's read rate (a vectorized sum over 512 MiB: read only, as a step
reads its weights); memcpy's rate, which reads and writes every byte, is shown beside it.
"""
import collections
import json
import sys


def weights_read_per_token(config):
    """Bytes of float32 weights one decoding step reads: every matrix and vector of the blocks,
    the final norm and the head (`vocab x width`), not the embedding tables' other rows."""
    if config["model_type"] == "gpt2":
        d, layers, vocab = config["n_embd"], config["n_layer"], config["vocab_size"]
        inner = config.get("n_inner") or 4 * d
        block = (d * 3 * d + 3 * d) + (d * d + d) + (d * inner + inner) + (inner * d + d) + 4 * d
        params = layers * block + 2 * d + vocab * d
    else:  # the Llama family: q/k/v/o, a gated MLP, two RMSNorms per block
        d, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
        heads = config["num_attention_heads"]
        kv = config.get("num_key_value_heads", heads)
        head_dim = config.get("head_dim") or d // heads
        ff = config["intermediate_size"]
        block = d * heads * head_dim * 2 + 2 * d * kv * head_dim + 3 * d * ff + 2 * d
        params = layers * block + d + vocab * d
    return 4 * params


def span(values, fmt="{:.3g}"):
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"


def ratios(mine, theirs):
    """Per-round ratios of two {round: value} maps, over the rounds both have."""
    return [mine[r] / theirs[r] for r in sorted(mine) if r in theirs]


def verdict(values, ok):
    hits = sum(ok(v) for v in values)
    if hits == len(values):
        return "met"
    return "missed" if hits == 0 else f"met in {hits} of {len(values)} rounds"


def main(path):
    # A line tagged by run-targets.sh may carry the binary's own `round` after the tag: the tag
    # (the first) is the round.
    first_wins = lambda pairs: dict(reversed(pairs))  # noqa: E731
    rows = [json.loads(line, object_pairs_hook=first_wins) for line in open(path) if line.startswith("{")]
    machine = next(r for r in rows if r.get("kind") == "machine")
    weights = {r["model"]: r["weight_bytes_per_token"] for r in rows if r.get("kind") == "weights"}
    memory = collections.defaultdict(dict)  # "memcpy" / "read" -> {round: best median GB/s}
    layer = collections.defaultdict(dict)  # (mode, threads, shape, who) -> {round: ms}
    lm = collections.defaultdict(dict)  # (model, batch, who, what) -> {round: value}
    products = collections.defaultdict(dict)  # (shape, who) -> {round: ms}
    for r in rows:
        kind, rnd = r.get("kind"), r.get("round")
        if kind == "linear":
            products[(r["shape"], "torch")][rnd] = r["median_ms"]
        elif "products_forward_ms" in r:
            products[(r["shape"], "ours")][rnd] = r["products_forward_ms"]
        elif kind in ("memcpy", "read"):
            memory[kind][rnd] = max(memory[kind].get(rnd, 0.0), r["gb_per_s_median"])
        elif kind == "attn":
            layer[(r["mode"], r["threads"], r["shape"], "sdpa")][rnd] = r["median_ms"]
        elif "median_ms" in r and "backend" in r:
            layer[(r["mode"], r["threads"], r["shape"], r["backend"])][rnd] = r["median_ms"]
        elif "decode_tokens_per_s" in r:
            who = "ours" if r["impl"] == "ours" else "transformers"
            lm[(r["model"], r["batch"], who, "prefill")][rnd] = r["prefill_ms"]
            lm[(r["model"], r["batch"], who, "decode")][rnd] = r["decode_tokens_per_s"]

    def best(mode, threads, shape):
        flex, ndarray = layer[(mode, threads, shape, "flex")], layer[(mode, threads, shape, "ndarray")]
        return {r: min(flex[r], ndarray.get(r, flex[r])) for r in flex}

    table = []
    for shape in sorted({key[0] for key in products}, key=lambda s: [int(d) for d in s.split("x")]):
        values = ratios(products[(shape, "ours")], products[(shape, "torch")])
        ms = span(list(products[(shape, "ours")].values()))
        table.append((f"projection {shape} (BATCHxSEQxINxOUT), ours / torch linear, 2 threads", "≤ 1.1",
                      f"×{span(values, '{:.2f}')} ({ms} ms)", verdict(values, lambda v: v <= 1.1)))
    shape = "1x1024x768x12"
    for mode, target, bound in (("fwd", "≤ 0.9", 0.9), ("fwdbwd", "≤ 1.0", 1.0)):
        for threads in (1, 2):
            values = ratios(best(mode, threads, shape), layer[(mode, threads, shape, "sdpa")])
            table.append((f"layer {mode} {shape}, best CPU path / sdpa, {threads} thread{'s' * (threads > 1)}",
                          target, f"×{span(values, '{:.2f}')}", verdict(values, lambda v: v <= bound)))
    for mode in ("fwd", "fwdbwd"):
        speedups = ratios(best(mode, 1, shape), best(mode, 2, shape))
        table.append((f"layer {mode} {shape}, best path 1 → 2 threads", "≥ 1.8",
                      f"×{span(speedups, '{:.2f}')}", verdict(speedups, lambda v: v >= 1.8)))
    for backend in ("flex", "ndarray"):
        times = list(layer[("decode", 2, shape, backend)].values())
        table.append((f"decode 1 token after 1023 cached, {backend}, 2 threads (ms)", "≤ 0.4",
                      span(times), verdict(times, lambda v: v <= 0.4)))
    for backend in ("flex", "ndarray"):
        long = "1x16384x768x12"
        speedups = ratios(layer[("decode", 1, long, backend)], layer[("decode", 2, long, backend)])
        ms = [*layer[("decode", 1, long, backend)].values()], [*layer[("decode", 2, long, backend)].values()]
        table.append((f"decode after 16 383 cached, {backend}, 1 → 2 threads",
                      "≥ 1.8", f"×{span(speedups, '{:.2f}')} ({span(ms[0])} → {span(ms[1])} ms)",
                      verdict(speedups, lambda v: v >= 1.8)))
    models = sorted({key[0] for key in lm}, key=lambda m: ("smol" in m, m))
    for model in models:
        for batch in (1, 8):
            prefill = ratios(lm[(model, batch, "ours", "prefill")], lm[(model, batch, "transformers", "prefill")])
            table.append((f"{model} prefill, batch {batch}, ours / transformers (time)", "≤ 1.0",
                          f"×{span(prefill, '{:.2f}')}", verdict(prefill, lambda v: v <= 1.0)))
        for batch in (1, 8):
            ours = lm[(model, batch, "ours", "decode")]
            decode = ratios(ours, lm[(model, batch, "transformers", "decode")])
            bound = 1.2
            table.append((f"{model} decode, batch {batch}, ours / transformers (tokens/s)", f"≥ {bound}",
                          f"×{span(decode, '{:.2f}')} ({span(list(ours.values()))} tokens/s)",
                          verdict(decode, lambda v: v >= bound)))
            if batch == 1 and model in weights:
                streamed = {r: ours[r] * weights[model] / 1e9 for r in ours}
                shares = {kind: [streamed[r] / memory[kind][r] for r in streamed if r in memory[kind]]
                          for kind in ("memcpy", "read")}
                table.append((f"{model} decode, batch 1: weights streamed ({weights[model] / 1e9:.3f} GB a "
                              f"token) / the machine's read rate ({span(list(memory['read'].values()))} GB/s; "
                              f"memcpy {span(list(memory['memcpy'].values()))} GB/s)", "≥ 80 %",
                              f"{span(list(streamed.values()))} GB/s: "
                              + span([100 * v for v in shares["read"]], "{:.0f}") + " % of the read rate, "
                              + span([100 * v for v in shares["memcpy"]], "{:.0f}") + " % of memcpy's",
                              verdict(shares["read"], lambda v: v >= 0.8)))
    rounds = len({r["round"] for r in rows if "round" in r})
    print(f"Machine: {machine['model_name']}, {machine['cpus']} CPUs, "
          f"AVX-512: {machine['avx512'] or 'none'}; {rounds} rounds.\n")
    print("| row | target | measured (range over rounds) | |")
    print("|---|---|---|---|")
    for row in table:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    if sys.argv[1] == "--weights":
        config = json.load(open(f"{sys.argv[2]}/config.json"))
        name = sys.argv[2].rstrip("/").split("/")[-1]
        print(json.dumps({"kind": "weights", "model": name,
                          "weight_bytes_per_token": weights_read_per_token(config)}))
    else:
        main(sys.argv[1])
