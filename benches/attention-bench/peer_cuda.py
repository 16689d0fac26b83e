#!/usr/bin/env python3
"""PyTorch's causal self-attention on a CUDA GPU, timed like our runner (`attention-bench`): the
same layer (four bias-free `nn.Linear` of width D, `scaled_dot_product_attention(is_causal=True)`),
or with `--core` the attention core alone (q, k, v → context; the heads' split and the key/value
heads' repetition done before the timed calls). One JSON line per shape with median/min/max
milliseconds per call; each timed run queues `--calls-per-sync` calls and ends with a device
sync, as ours does.

    python3 peer_cuda.py --mode fwd --shapes 1x1024x768x12,4x512x768x12 --repeats 10
    python3 peer_cuda.py --core --dtype bf16 --mode fwdbwd --shapes 1x4096x768x12 --calls-per-sync 20

`--mode decode`: one query over SEQ keys (the core) or one token after SEQ-1 cached (the layer,
its cache kept as a growing tensor as transformers' DynamicCache does). `--tf32` lets cuBLAS and
SDPA use TF32 tensor cores (PyTorch's default is off for matmuls).
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class Layer(torch.nn.Module):
    def __init__(self, d, h, kv):
        super().__init__()
        self.h, self.kv, self.hd = h, kv, d // h
        self.q, self.o = (torch.nn.Linear(d, d, bias=False) for _ in range(2))
        self.k, self.v = (torch.nn.Linear(d, kv * self.hd, bias=False) for _ in range(2))

    def attend(self, q, k, v, window, causal=True):
        b, t, _ = q.shape
        s = k.shape[1]
        split = lambda y, n: y.view(b, y.shape[1], n, self.hd).transpose(1, 2)
        mask = None
        if window is not None:
            i = torch.arange(t, device=q.device)[:, None] + (s - t)
            j = torch.arange(s, device=q.device)[None, :]
            mask = (j <= i) & (i - j < window)
        ctx = F.scaled_dot_product_attention(
            split(q, self.h), split(k, self.kv), split(v, self.kv), attn_mask=mask,
            is_causal=causal and mask is None and t == s, enable_gqa=self.kv != self.h)
        return self.o(ctx.transpose(1, 2).reshape(b, t, self.h * self.hd))

    def forward(self, x, window):
        return self.attend(self.q(x), self.k(x), self.v(x), window)


def step_fn(args, b, t, d, h):
    """A closure that makes one call, and the nominal FLOPs of one."""
    torch.manual_seed(0)
    dtype, kv = DTYPES[args.dtype], args.num_kv_heads or h
    hd, train = d // h, args.mode == "fwdbwd"
    if args.core:
        queries = 1 if args.mode == "decode" else t
        make = lambda n, s: torch.randn(b, n, s, hd, device=args.device, dtype=dtype, requires_grad=train)
        q, k, v = make(h, queries), make(kv, t), make(kv, t)
        mask = None
        if args.sliding_window is not None:
            i = torch.arange(queries, device=args.device)[:, None] + (t - queries)
            j = torch.arange(t, device=args.device)[None, :]
            mask = (j <= i) & (i - j < args.sliding_window)
        causal = mask is None and args.mode != "decode"

        def call():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                 enable_gqa=kv != h)
            if train:
                out.sum().backward()
        flops = 4 * b * queries * t * d
    else:
        layer = Layer(d, h, kv).to(args.device, dtype)
        if args.mode == "decode":
            x = torch.randn(b, 1, d, device=args.device, dtype=dtype)
            past = torch.randn(b, t - 1, d, device=args.device, dtype=dtype)
            with torch.no_grad():
                cache_k, cache_v = layer.k(past), layer.v(past)

            def call():
                with torch.no_grad():
                    k = torch.cat([cache_k, layer.k(x)], 1)
                    v = torch.cat([cache_v, layer.v(x)], 1)
                    layer.attend(layer.q(x), k, v, args.sliding_window, causal=False)
            flops = 8 * b * d * d + 4 * b * t * d
        else:
            x = torch.randn(b, t, d, device=args.device, dtype=dtype, requires_grad=train)

            def call():
                if train:
                    layer.zero_grad(set_to_none=True)
                    x.grad = None
                    layer(x, args.sliding_window).sum().backward()
                else:
                    with torch.no_grad():
                        layer(x, args.sliding_window)
            flops = 8 * b * t * d * d + 4 * b * t * t * d
    return call, flops * (3 if train else 1)


def time_shape(args, b, t, d, h):
    call, flops = step_fn(args, b, t, d, h)

    def iteration():
        for _ in range(args.calls_per_sync):
            call()
        if args.device == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        iteration()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        iteration()
        times.append((time.perf_counter() - start) * 1e3 / args.calls_per_sync)
    median = statistics.median(times)
    cuda = args.device == "cuda"
    return dict(backend=args.device, impl="torch-sdpa", mode=args.mode, core=args.core, dtype=args.dtype,
                compiler="cuda" if args.device == "cuda" else None, calls_per_sync=args.calls_per_sync, shape=f"{b}x{t}x{d}x{h}",
                num_kv_heads=args.num_kv_heads or h, sliding_window=args.sliding_window,
                repeats=args.repeats, median_ms=round(median, 4), min_ms=round(min(times), 4),
                max_ms=round(max(times), 4), gflops=round(flops / median / 1e6, 1),
                peak_gpu_mib=round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None,
                torch=torch.__version__, device=torch.cuda.get_device_name() if cuda else "cpu")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["fwd", "fwdbwd", "decode"], default="fwd")
    ap.add_argument("--shapes", required=True, help="comma list of BATCHxSEQxDIMxHEADS")
    ap.add_argument("--core", action="store_true", help="the attention core alone")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    ap.add_argument("--num-kv-heads", type=int)
    ap.add_argument("--sliding-window", type=int)
    ap.add_argument("--calls-per-sync", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tf32", action="store_true")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a check of this script where no GPU is")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    for shape in args.shapes.split(","):
        b, t, d, h = (int(v) for v in shape.split("x"))
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        print(json.dumps(time_shape(args, b, t, d, h)), flush=True)


if __name__ == "__main__":
    main()
