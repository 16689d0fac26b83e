"""PyTorch's product of a projection, `torch.nn.functional.linear(x, W, b)` in float32, timed per
shape as `linear-grad-rate --forward-only` times ours, for the products row of the CPU targets.

    python peer_linear.py --threads 2 --shape 8x128x768x3072 --shape 1x128x768x2304

Shapes are `BATCHxSEQxINxOUT` (x is `[BATCH, SEQ, IN]`, W `[OUT, IN]` as nn.Linear keeps it). One
JSON object per shape: the median of `--repeats` calls after one warm-up, and the GFLOP/s it makes.
"""

import argparse
import json
import statistics
import time

import torch


def parse_shape(text):
    dims = [int(dim) for dim in text.split("x")]
    if len(dims) != 4 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"`{text}` is not BATCHxSEQxINxOUT")
    return dims


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=parse_shape, action="append", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for batch, seq, inputs, outputs in args.shape:
        x = torch.randn(batch, seq, inputs)
        weight = torch.randn(outputs, inputs) / inputs**0.5
        bias = torch.randn(outputs)
        with torch.inference_mode():
            torch.nn.functional.linear(x, weight, bias)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                torch.nn.functional.linear(x, weight, bias)
                times.append((time.perf_counter() - start) * 1e3)
        median = statistics.median(times)
        print(json.dumps({
            "kind": "linear", "impl": "torch", "threads": args.threads,
            "shape": f"{batch}x{seq}x{inputs}x{outputs}", "median_ms": median,
            "gflops": 2 * batch * seq * inputs * outputs / median / 1e6,
        }), flush=True)


if __name__ == "__main__":
    main()
