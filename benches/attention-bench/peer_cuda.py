#!/usr/bin/env python3
"""PyTorch's causal self-attention layer on a CUDA GPU, timed like our runner: the same layer
(four bias-free `nn.Linear` of width D, `scaled_dot_product_attention(is_causal=True)`), float32,
one JSON line per shape with median/min/max milliseconds, each timed run ended by a device sync.

    python3 peer_cuda.py --mode fwd --shapes 1x1024x768x12,4x512x768x12 --repeats 10

`--tf32` lets cuBLAS and SDPA use TF32 tensor cores (PyTorch's default is off for matmuls).
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


class Layer(torch.nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h, self.hd = h, d // h
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        split = lambda y: y.view(b, t, self.h, self.hd).transpose(1, 2)
        ctx = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)),
                                             is_causal=True)
        return self.o(ctx.transpose(1, 2).reshape(b, t, d))


def time_shape(mode, b, t, d, h, repeats, warmup):
    torch.manual_seed(0)
    layer = Layer(d, h).cuda()
    x = torch.randn(b, t, d, device="cuda", requires_grad=(mode == "fwdbwd"))
    gy = torch.randn(b, t, d, device="cuda")

    def step():
        if mode == "fwd":
            with torch.no_grad():
                layer(x)
        else:
            layer.zero_grad(set_to_none=True)
            x.grad = None
            layer(x).backward(gy)
        torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    proj = 8 * b * t * d * d
    flops = (proj + 4 * b * t * t * d) * (3 if mode == "fwdbwd" else 1)
    median = statistics.median(times)
    return dict(backend="cuda", impl="torch-sdpa", mode=mode, shape=f"{b}x{t}x{d}x{h}",
                repeats=repeats, median_ms=round(median, 4), min_ms=round(min(times), 4),
                max_ms=round(max(times), 4), gflops=round(flops / median / 1e6, 1),
                peak_gpu_mib=round(torch.cuda.max_memory_allocated() / 2**20, 1),
                torch=torch.__version__, device=torch.cuda.get_device_name())


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mode", choices=["fwd", "fwdbwd"], default="fwd")
    ap.add_argument("--shapes", required=True, help="comma list of BATCHxSEQxDIMxHEADS")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tf32", action="store_true")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    for shape in args.shapes.split(","):
        b, t, d, h = (int(v) for v in shape.split("x"))
        torch.cuda.reset_peak_memory_stats()
        print(json.dumps(time_shape(args.mode, b, t, d, h, args.repeats, args.warmup)), flush=True)


if __name__ == "__main__":
    main()
