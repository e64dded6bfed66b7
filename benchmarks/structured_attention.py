"""Cost of structured (path-window) attention: causal vs dense 4D mask vs FlexAttention BlockMask.

One forward + backward of a random-init Qwen3 on sequences laid out like Unseen training data
(a prompt, then two blocks of two paths spanning about half the sequence, summaries, more text).
Variants, all in the same run and printed as ratios against `causal`:
  causal       sdpa, no mask (is_causal: flash / efficient kernels) -- the Seen baseline
  dense        sdpa with the structured bool [B,1,L,L] mask + multiverse positions
  flex_causal  flex_attention with a plain causal BlockMask (flex overhead alone)
  flex         flex_attention with the structured BlockMask + multiverse positions
Time includes building the structure and the mask (the trainer does it every batch); `build ms`
shows that part alone. Memory: on CUDA torch.cuda.max_memory_allocated during the step minus
the memory allocated before it; on CPU the peak resident set size (RSS, /proc/self/statm sampled
every millisecond in a thread) minus RSS before the step, with glibc told to unmap freed blocks
(mallopt) so that RSS follows live tensors. Variants take turns every repeat, so that load from
other processes hits them alike; flex_attention has no backward on CPU and is reported skipped.

Needs only torch + transformers. Commands:
  python benchmarks/structured_attention.py --size tiny --device cpu --seq-lens 256 512 1024
  python benchmarks/structured_attention.py --size 4b --device cuda --seq-lens 1024 2048 4096 8192
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel_r1.structure import TagIds, attention_inputs, build_structure  # noqa: E402

VARIANTS = ("causal", "dense", "flex_causal", "flex")
SIZES = {
    "tiny": dict(vocab_size=1000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=32),
    "4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}


def build_model(size: str, device: str, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SIZES[size], max_position_embeddings=40960, tie_word_embeddings=size == "tiny")
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.train()


def layout(length: int, vocab: int, tags: TagIds, generator: torch.Generator) -> list[int]:
    """Prompt (1/4), then two blocks of two paths (1/4 each), summaries and text in between."""
    def text(n):
        return torch.randint(10, tags.parallel_open - 10, (max(n, 1),), generator=generator).tolist()

    def block(n):
        half = max(n // 2 - 2, 1)
        return ([tags.parallel_open, tags.path_open] + text(half) + [tags.path_close, tags.path_open]
                + text(half * 3 // 4) + [tags.path_close, tags.parallel_close, tags.summary_open]
                + text(n // 16) + [tags.summary_close])

    ids = text(length // 4) + block(length // 4) + text(length // 16) + block(length // 4)
    ids += text(length - len(ids))
    return ids[:length]


class PeakMemory:
    """Peak memory of a step in MiB: CUDA allocator stats, or sampled process RSS on CPU."""

    def __init__(self, device: str):
        self.device = device
        self.page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            self.start = self.peak = self._rss()
            self.running = True
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.mib = (torch.cuda.max_memory_allocated() - self.start) / 2**20
        else:
            self.running = False
            self.thread.join()
            self.mib = (max(self.peak, self._rss()) - self.start) / 2**20


def step(model, ids: torch.Tensor, variant: str, tags: TagIds) -> float:
    """One forward + backward; returns the milliseconds spent building the structure and mask."""
    t0 = time.perf_counter()
    if variant == "causal":
        kwargs = {}
    else:
        impl = "sdpa" if variant == "dense" else "flex_attention"
        structure = build_structure(ids, None, tags, structured=variant != "flex_causal")
        kwargs = attention_inputs(structure, impl, dtype=next(model.parameters()).dtype)
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    build_ms = (time.perf_counter() - t0) * 1000
    loss = model(input_ids=ids, labels=ids, **kwargs).loss
    loss.backward()
    return build_ms


def measure(model, ids, variants, tags, warmup: int, repeats: int, device: str) -> dict:
    """Median ms, build ms and peak MiB per variant; variants take turns every repeat."""
    results: dict[str, str | tuple[float, float, float]]
    results, runnable = {}, []
    for variant in variants:
        model.set_attn_implementation("sdpa" if variant in ("causal", "dense") else "flex_attention")
        try:
            for _ in range(warmup):
                model.zero_grad(set_to_none=True)
                step(model, ids, variant, tags)
            runnable.append(variant)
        except Exception as error:  # a backend this machine cannot run is reported, not fatal
            results[variant] = f"skipped: {type(error).__name__}: {str(error).splitlines()[0][:80]}"
    samples: dict[str, tuple[list[float], list[float], list[float]]] = {variant: ([], [], [])
                                                                         for variant in runnable}
    for _ in range(repeats):
        for variant in runnable:
            model.set_attn_implementation("sdpa" if variant in ("causal", "dense") else "flex_attention")
            times, builds, peaks = samples[variant]
            model.zero_grad(set_to_none=True)  # gradients are allocated inside the measured step
            with PeakMemory(device) as memory:
                t0 = time.perf_counter()
                builds.append(step(model, ids, variant, tags))
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1000)
            peaks.append(memory.mib)
    for variant, (times, builds, peaks) in samples.items():
        results[variant] = (statistics.median(times), statistics.median(builds), statistics.median(peaks))
    return results


def return_freed_memory_to_os() -> None:
    """Make glibc unmap freed tensors at once, so that process RSS follows live CPU memory."""
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    libc.mallopt(m_trim_threshold, 0)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible")
    if args.device == "cpu":
        return_freed_memory_to_os()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(args.size, args.device, dtype)
    vocab = model.config.vocab_size
    tags = (TagIds(*range(vocab - 267, vocab - 261)) if args.size == "4b"
            else TagIds(*range(vocab - 10, vocab - 4)))
    memory_note = ("torch.cuda.max_memory_allocated - allocated before the step" if args.device == "cuda"
                   else "peak RSS (/proc/self/statm every 1 ms, glibc mmap threshold 64 KiB) "
                        "- RSS before the step")
    print(f"torch {torch.__version__}, size {args.size}, device {args.device}, dtype {dtype}, "
          f"threads {torch.get_num_threads()}, batch {args.batch}, median of {args.repeats} after "
          f"{args.warmup} warm-up; memory: {memory_note}")
    generator = torch.Generator().manual_seed(0)
    header = (f"{'seq_len':>7}  {'variant':<11} {'ms':>9} {'ratio':>6} {'build ms':>9} {'peak MiB':>9} "
              f"{'+MiB vs causal':>15}")
    print(header)
    print("-" * len(header))
    for length in args.seq_lens:
        ids = torch.tensor([layout(length, vocab, tags, generator) for _ in range(args.batch)],
                           device=args.device)
        results = measure(model, ids, args.variants, tags, args.warmup, args.repeats, args.device)
        base = results.get("causal") if isinstance(results.get("causal"), tuple) else None
        for variant in args.variants:
            result = results[variant]
            if isinstance(result, str):
                print(f"{length:>7}  {variant:<11} {result}")
                continue
            ms, build_ms, mib = result
            ratio = f"{ms / base[0]:.2f}" if base else "n/a"
            extra = f"{mib - base[2]:+.1f}" if base else "n/a"
            print(f"{length:>7}  {variant:<11} {ms:>9.1f} {ratio:>6} {build_ms:>9.1f} {mib:>9.1f} "
                  f"{extra:>15}", flush=True)

if __name__ == "__main__":
    main()
