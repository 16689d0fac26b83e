"""transformers' GPT-2 `generate`, timed as `lm-bench` times ours, for side-by-side figures.

    # a GPT-2-small-shaped model with random weights, as save_pretrained writes it
    python peer_lm.py --save /tmp/gpt2-small
    # prefill and decode of batch 1 and 8, 128-token prompts, 128 new tokens, 2 threads
    python peer_lm.py --model /tmp/gpt2-small --batch 1,8 --prompt 128 --new 128 --threads 2

One JSON object per batch size. Both sides time whole `generate` calls with greedy decoding:
`prefill` is the call that makes 1 new token (the prompt's forward pass and one pick), `total`
the one that makes `--new`; the decode rate is `batch · (new − 1) / (total − prefill)`. The
prompt ids are `(row · 7919 + column · 104729) mod vocab`, the same formula as lm-bench.
`min_new_tokens` keeps transformers from stopping at an end-of-sequence id (ours never stops
early: a finished row continues with pads), so both run every step.
"""

import argparse
import json
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def save(directory, seed):
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
    GPT2LMHeadModel(config).save_pretrained(directory)


def prompt_ids(batch, length, vocab):
    rows = [[(row * 7919 + column * 104729) % vocab for column in range(length)] for row in range(batch)]
    return torch.tensor(rows, dtype=torch.int64)


def timed_generate(model, ids, new_tokens):
    start = time.perf_counter()
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=model.config.eos_token_id,
    )
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--save", help="write a random GPT-2-small to this directory and exit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.save:
        save(args.save, args.seed)
        return
    torch.set_num_threads(args.threads)
    model = GPT2LMHeadModel.from_pretrained(args.model).eval()
    with torch.inference_mode():
        for batch in [int(b) for b in args.batch.split(",")]:
            ids = prompt_ids(batch, args.prompt, model.config.vocab_size)
            timed_generate(model, ids, 2)  # warm-up
            prefill = sorted(timed_generate(model, ids, 1) for _ in range(args.repeats))
            total = sorted(timed_generate(model, ids, args.new) for _ in range(args.repeats))
            prefill_s, total_s = statistics.median(prefill), statistics.median(total)
            print(json.dumps({
                "impl": "transformers",
                "torch": torch.__version__,
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
