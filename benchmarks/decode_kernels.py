"""The two decode-step kernels of the transformers engine against what they replace, in one run.

  1. attention of one decode step over a masked, left-padded KV cache with grouped KV heads:
     `sdpa_gqa` (KV heads passed as they are, `enable_gqa`) vs transformers' "sdpa" (each KV
     head copied per query group whenever a mask is given); with --dtype bfloat16 ours is the
     grouped two-matmul step (`grouped_decode_attention`: the CPU SDPA kernel is slow in bf16);
  2. appending one column per step to a layer's KV cache: `GrowingLayer` (spare columns) vs
     transformers' `DynamicLayer` (a concatenation of the whole cache per step).
Shapes default to SmolLM2-135M's attention (9 query heads, 3 KV heads, head dim 64). Prints the
times and ratios and writes metrics/bench/decode_kernels.json.

    python benchmarks/decode_kernels.py
    python benchmarks/decode_kernels.py --rows 16 --columns 1000
    python benchmarks/decode_kernels.py --dtype bfloat16 --rows 64 --columns 600
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers.cache_utils import DynamicLayer  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from parallel_r1.engine.attention import gqa_sdpa_forward  # noqa: E402
from parallel_r1.engine.kv_pool import GrowingLayer  # noqa: E402


def seconds(work, repeats: int) -> float:
    work()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        work()
    return (time.perf_counter() - start) / repeats


def attention(args) -> dict:
    module: Any = SimpleNamespace(num_key_value_groups=args.heads // args.kv_heads, is_causal=True)
    dtype = getattr(torch, args.dtype)
    query = torch.randn(args.rows, args.heads, 1, args.head_dim, dtype=dtype)
    key, value = (torch.randn(args.rows, args.kv_heads, args.columns, args.head_dim, dtype=dtype)
                  for _ in range(2))
    mask = torch.ones(args.rows, 1, 1, args.columns, dtype=torch.bool)
    mask[:, :, :, : args.columns // 4] = torch.rand(args.rows, 1, 1, 1) > 0.5  # left padding on some rows
    ours = seconds(lambda: gqa_sdpa_forward(module, query, key, value, mask), args.repeats)
    theirs = seconds(lambda: sdpa_attention_forward(module, query, key, value, mask), args.repeats)
    same = torch.allclose(gqa_sdpa_forward(module, query, key, value, mask)[0],
                          sdpa_attention_forward(module, query, key, value, mask)[0],
                          atol=1e-5 if dtype == torch.float32 else 2e-2)  # bf16: its rounding
    return {"sdpa_gqa_ms": ours * 1e3, "sdpa_ms": theirs * 1e3, "speedup": theirs / ours, "same_output": same}


def append(args) -> dict:
    def grow(kind) -> None:
        layer = kind()
        layer.update(*(torch.randn(args.rows, args.kv_heads, args.columns, args.head_dim) for _ in range(2)))
        column = torch.randn(args.rows, args.kv_heads, 1, args.head_dim)
        for _ in range(args.steps):
            layer.update(column, column)

    ours = seconds(lambda: grow(GrowingLayer), 1)
    theirs = seconds(lambda: grow(DynamicLayer), 1)
    return {"steps": args.steps, "growing_s": ours, "dynamic_s": theirs, "speedup": theirs / ours}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--columns", type=int, default=500, help="cached tokens per row")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="attention inputs' dtype (the append comparison stays float32)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--steps", type=int, default=300, help="decode steps appended per layer")
    args = parser.parse_args()
    results = {"shape": vars(args), "attention": attention(args), "append": append(args)}
    print(json.dumps(results, indent=1))
    os.makedirs("metrics/bench", exist_ok=True)
    with open("metrics/bench/decode_kernels.json", "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
