"""transformers' `generate` on a causal LM, timed as `lm-bench` times ours, for side-by-side figures.

    # random weights (seeded) in the shape of GPT-2 small, SmolLM2-135M or Qwen3-0.6B, written as
    # save_pretrained writes them (config.json, model.safetensors, float32) for lm-bench to load
    python peer_lm.py --family gpt2 --save /tmp/gpt2-small
    python peer_lm.py --family smollm2 --save /tmp/smollm2-135m
    python peer_lm.py --family qwen3 --save /tmp/qwen3-0.6b
    # prefill and decode of batch 1 and 8, 128-token prompts, 128 new tokens, 2 threads
    python peer_lm.py --model /tmp/gpt2-small --batch 1,8 --prompt 128 --new 128 --threads 2
    # the same without a directory: the random model of --family, built in memory
    python peer_lm.py --family smollm2 --batch 1 --prompt 128 --new 128 --threads 2
    # a quick check: the family's shape cut to 2 layers (with --save or in memory)
    python peer_lm.py --family qwen3 --layers 2 --batch 1 --prompt 16 --new 4 --repeats 1
    # on a CUDA GPU in bfloat16 (the float32 checkpoint cast after loading)
    python peer_lm.py --model /tmp/gpt2-small --device cuda --dtype bfloat16 --batch 1,8 --new 64
    # a workload file (lm-bench --workload's) through transformers' continuous batching
    python peer_lm.py --model /tmp/gpt2-small --workload ../lm-bench/workloads/a-mixed.jsonl

One JSON object per batch size; its `family` is `--family` when given (with --model it must match
the directory's `model_type`), else that `model_type` (a saved SmolLM2 shape reads as `llama`). Both sides time whole `generate` calls with
greedy decoding: `prefill` is the call that makes 1 new token (the prompt's forward pass and one
pick), `total` the one that makes `--new`; the decode rate is `batch · (new − 1) / (total −
prefill)`. The prompt ids are `(row · 7919 + column · 104729) mod vocab`, the same formula as
lm-bench. `min_new_tokens` keeps transformers from stopping at an end-of-sequence id (ours never
stops early: a finished row continues with pads), so both run every step. Models run in float32.

`--workload FILE.jsonl` (lines of `ids` and `max_new_tokens`, greedy, no stop ids) runs every
request through transformers' continuous batching (`continuous_batching_context_manager`, the
loop `generate_batch` wraps, given each request's own limit through `add_request`) with the
`sdpa` attention implementation (transformers 5.25 takes plain `sdpa` for continuous batching and
warns that the `paged|` prefix is no longer needed), its cache sized as lm-bench's engine:
`--kv-mib` over every layer in pages of `--page-size`, at most `--max-running` requests and
`--step-tokens` tokens a batch. Every request is added at the start, so a time to first token
counts its wait; one JSON line, with lm-bench's workload fields.
"""

import argparse
import json
import math
import os
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen3Config


def gpt2_config():
    """GPT-2 small."""
    return GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)


def smollm2_config():
    """SmolLM2-135M's shape."""
    return LlamaConfig(
        num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
        rms_norm_eps=1e-5, max_position_embeddings=8192, hidden_act="silu", bos_token_id=0,
        eos_token_id=0,
    )


def qwen3_config():
    """Qwen3-0.6B's shape."""
    return Qwen3Config(
        num_hidden_layers=28, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960, hidden_act="silu",
        bos_token_id=151643, eos_token_id=151645,
    )


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FAMILIES = {"gpt2": gpt2_config, "smollm2": smollm2_config, "qwen3": qwen3_config}
MODEL_TYPES = {"gpt2": "gpt2", "smollm2": "llama", "qwen3": "qwen3"}  # config.json's model_type


def random_model(family, seed, layers=None):
    """The family's model with random weights from `seed`, float32; `layers` overrides the depth."""
    config = FAMILIES[family]()
    if layers is not None:
        config.num_hidden_layers = layers  # n_layer for GPT-2 (an alias)
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = config.layer_types[:layers]
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def prompt_ids(batch, length, vocab):
    rows = [[(row * 7919 + column * 104729) % vocab for column in range(length)] for row in range(batch)]
    return torch.tensor(rows, dtype=torch.int64)


def timed_generate(model, ids, new_tokens, pad):
    synchronize(ids.device)
    start = time.perf_counter()
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad,
    )
    synchronize(ids.device)
    return time.perf_counter() - start


def synchronize(device):
    """Waits for the device's queued work: a CUDA call is timed to its end, not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def quantile(values, q):
    """The `q`-quantile of `values`, nearest rank (as lm-bench's)."""
    values = sorted(values)
    if not values:
        return float("nan")
    rank = min(max(math.ceil(q * len(values)), 1), len(values))
    return values[rank - 1]


def run_workload(model, family, args):
    """Times `args.workload` through transformers' continuous batching; prints one JSON line."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    with open(args.workload) as file:
        requests = [json.loads(line) for line in file if line.strip()]
    config = model.config
    layers = config.num_hidden_layers
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = torch.finfo(model.dtype).bits // 8
    bytes_per_block = args.page_size * layers * 2 * kv_heads * head_dim * element
    blocks = (args.kv_mib << 20) // bytes_per_block
    generation = GenerationConfig(
        do_sample=False, max_new_tokens=max(r["max_new_tokens"] for r in requests), eos_token_id=-1,
        pad_token_id=0,
    )
    batching = ContinuousBatchingConfig(
        page_size=args.page_size, num_blocks=blocks, max_batch_tokens=args.step_tokens,
        max_requests_per_batch=args.max_running,
    )
    generated = 0
    times = {}
    with model.continuous_batching_context_manager(
        generation_config=generation, continuous_batching_config=batching, block=True, timeout=5,
    ) as manager:
        start = time.perf_counter()
        for number, request in enumerate(requests):
            manager.add_request(
                request["ids"], request_id=str(number), max_new_tokens=request["max_new_tokens"],
                record_timestamps=True, eos_token_id=-1,
            )
        while len(times) < len(requests):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise SystemExit("transformers' generation loop stopped early")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise SystemExit(f"request {result.request_id}: {result.error}")
                limit = requests[int(result.request_id)]["max_new_tokens"]
                if len(result.generated_tokens) != limit:
                    raise SystemExit(f"request {result.request_id}: {len(result.generated_tokens)} tokens, not {limit}")
                generated += len(result.generated_tokens)
                times[result.request_id] = [t - start for t in result.timestamps]
        seconds = time.perf_counter() - start
    first = [t[0] for t in times.values() if t]
    gaps = [(b - a) * 1e3 for t in times.values() for a, b in zip(t, t[1:])]
    import transformers
    print(json.dumps({
        "impl": "transformers",
        "mode": "continuous",
        "family": family,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "attn_implementation": model.config._attn_implementation,
        "device": args.device,
        "dtype": args.dtype,
        "workload": os.path.basename(args.workload),
        "requests": len(requests),
        "threads": torch.get_num_threads(),
        "generated_tokens": generated,
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
        "ttft_s_p50": quantile(first, 0.5),
        "ttft_s_p95": quantile(first, 0.95),
        "itl_ms_p50": quantile(gaps, 0.5),
        "itl_ms_p95": quantile(gaps, 0.95),
        "page_size": args.page_size,
        "blocks": blocks,
        "step_tokens": args.step_tokens,
        "max_running": args.max_running,
    }), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES),
                        help="shape of the random model to build (default gpt2); with --model, only the label")
    parser.add_argument("--layers", type=int, help="override the family's layer count (quick checks)")
    parser.add_argument("--save", metavar="DIR", help="write the random model of --family to DIR and exit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", metavar="DIR", help="time this save_pretrained directory instead")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where transformers runs (cuda: each call timed to the device's end)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                        help="the weights' and activations' float type on --device")
    parser.add_argument("--workload", metavar="FILE",
                        help="time a JSON-lines file of requests through continuous batching")
    parser.add_argument("--kv-mib", type=int, default=1024, help="with --workload: the cache, over every layer")
    parser.add_argument("--page-size", type=int, default=128, help="with --workload: positions per page")
    parser.add_argument("--max-running", type=int, default=32, help="with --workload: requests a batch")
    parser.add_argument("--step-tokens", type=int, default=512, help="with --workload: tokens a batch")
    args = parser.parse_args()
    if args.model and (args.save or args.layers is not None):
        parser.error("--model loads a directory as it is: no --save or --layers with it")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be at least 1")
    if args.save:
        random_model(args.family or "gpt2", args.seed, args.layers).save_pretrained(args.save)
        return
    torch.set_num_threads(args.threads)
    if args.model:
        attention = {"attn_implementation": "sdpa"} if args.workload else {}
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, **attention)
        model_type = AutoConfig.from_pretrained(args.model).model_type
        if args.family and MODEL_TYPES[args.family] != model_type:
            parser.error(f"--family {args.family} is model_type {MODEL_TYPES[args.family]}, {args.model} holds {model_type}")
        family = args.family or model_type
    else:
        family = args.family or "gpt2"
        model = random_model(family, args.seed, args.layers)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this PyTorch sees no CUDA device")
    model = model.to(device=args.device, dtype=DTYPES[args.dtype])
    model.eval()
    if args.workload:
        if not args.model:
            parser.error("--workload needs --model (the directory lm-bench times)")
        run_workload(model, family, args)
        return
    eos = model.config.eos_token_id
    pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    with torch.inference_mode():
        for batch in [int(b) for b in args.batch.split(",")]:
            ids = prompt_ids(batch, args.prompt, model.config.vocab_size).to(args.device)
            timed_generate(model, ids, 2, pad)  # warm-up
            prefill = sorted(timed_generate(model, ids, 1, pad) for _ in range(args.repeats))
            total = sorted(timed_generate(model, ids, args.new, pad) for _ in range(args.repeats))
            prefill_s, total_s = statistics.median(prefill), statistics.median(total)
            print(json.dumps({
                "impl": "transformers",
                "family": family,
                "torch": torch.__version__,
                "device": args.device,
                "dtype": args.dtype,
                "batch": batch,
                "prompt": args.prompt,
                "new": args.new,
                "threads": torch.get_num_threads(),
                "repeats": args.repeats,
                "prefill_ms": prefill_s * 1e3,
                "prefill_ms_range": [prefill[0] * 1e3, prefill[-1] * 1e3],
                "total_ms": total_s * 1e3,
                "total_ms_range": [total[0] * 1e3, total[-1] * 1e3],
                "decode_tokens_per_s": batch * (args.new - 1) / (total_s - prefill_s),
            }), flush=True)


if __name__ == "__main__":
    main()
