"""Parallel rollout throughput: the same rollouts through every available backend, in one run.

A tiny random-init Qwen3 (the project's tiny profile size, real 152k Qwen3 vocabulary) answers
GSM8K test questions rendered with the Parallel Thinking prompt, `--generations` rollouts each,
through the fork loop (parallel=True; `--plain` for plain generation). A random model almost
never writes `<Parallel>`, so the `<Parallel>`, `</Path>` and `</Summary>` embedding rows are
scaled by `--tag-scale` to make it fork, and blocks/rollout is printed: the runs exercise the
forks, not just plain decoding.

tok/s counts every completion token (main text, all paths, summaries, inserted tags) per second
of `generate`; vLLM's engine start-up is timed apart. Each backend runs once untimed (warm-up),
then is timed; ratios are against the transformers backend of the same run. The backends see
the same prompts and seeds but do not sample identical tokens (different kernels). `vllm` adds
segments to vLLM's running engine as rollouts reach them (continuous scheduling); `vllm-rounds`
serves each round of segments with one blocking `generate` (the round barrier), on the same seeds,
so their ratio is what continuous scheduling buys. Writes metrics/bench/rollout_throughput.json.

    python benchmarks/rollout_throughput.py                       # every backend where vLLM is installed
    python benchmarks/rollout_throughput.py --backends transformers --prompts 16
    python benchmarks/rollout_throughput.py --plain             # plain generation (teacher stage)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import cast

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel_r1.engine import EngineKind, RolloutConfig, make_engine, vllm_available  # noqa: E402
from parallel_r1.models import TinyModelConfig, build_tiny_model, load_tokenizer, qwen3_tokenizer_dir  # noqa: E402
from parallel_r1.prompts import render_prompt  # noqa: E402
from parallel_r1.structure import TagIds  # noqa: E402

GSM8K_TEST = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.pardir, "shared",
                          "data", "gsm8k", "test.jsonl")


def fork_prone_model(folder: str, tag_scale: float):
    """Save the tiny model with its fork tags' embedding rows scaled; return the tokenizer."""
    import torch

    tokenizer = load_tokenizer(qwen3_tokenizer_dir())
    model = build_tiny_model(tokenizer, TinyModelConfig())
    tags = TagIds.from_tokenizer(tokenizer)
    with torch.no_grad():
        for tag in (tags.parallel_open, tags.path_close, tags.summary_close):
            model.get_input_embeddings().weight[tag] *= tag_scale
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return tokenizer


def measure(kind: str, folder: str, tokenizer, prompt_ids, args) -> dict:
    config = RolloutConfig(parallel=not args.plain, max_tokens=args.max_tokens, temperature=1.0, seed=0)
    started = time.perf_counter()
    scheduling = {"vllm": "continuous", "vllm-rounds": "rounds"}.get(kind)  # transformers: its default (auto)
    engine = make_engine(cast(EngineKind, kind.split("-")[0]), folder, tokenizer, config, dtype="float32",
                         scheduling=scheduling)
    startup = time.perf_counter() - started
    try:
        engine.generate(prompt_ids[:2], 1)  # warm-up
        started = time.perf_counter()
        rollouts = engine.generate(prompt_ids, args.generations)
        seconds = time.perf_counter() - started
    finally:
        engine.close()
    tokens = sum(len(r.completion_ids) for r in rollouts)
    return dict(backend=kind, startup_s=startup, seconds=seconds, tokens=tokens,
                sampled=sum(sum(r.env_mask) for r in rollouts), tokens_per_s=tokens / seconds,
                blocks_per_rollout=sum(r.num_blocks for r in rollouts) / len(rollouts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--tag-scale", type=float, default=30.0)
    parser.add_argument("--backends", nargs="+", default=["transformers", "vllm", "vllm-rounds"],
                        choices=["transformers", "vllm", "vllm-rounds"])
    parser.add_argument("--data", default=GSM8K_TEST)
    parser.add_argument("--plain", action="store_true",
                        help="plain generation without forking (teacher generation, the GRPO baselines)")
    args = parser.parse_args()
    backends = [b for b in args.backends if not b.startswith("vllm") or vllm_available()]
    with open(args.data, encoding="utf-8") as source:
        questions = [json.loads(line)["question"]
                     for _, line in zip(range(args.prompts), source, strict=False)]
    with tempfile.TemporaryDirectory(prefix="rollout_bench_") as folder:
        tokenizer = fork_prone_model(folder, args.tag_scale)
        prompt_ids = [tokenizer(render_prompt(tokenizer, q), add_special_tokens=False)["input_ids"]
                      for q in questions]
        results = [measure(kind, folder, tokenizer, prompt_ids, args) for kind in backends]
    print(f"rollout throughput: tiny Qwen3 {TinyModelConfig()}, vocab {len(tokenizer)}; "
          f"{len(questions)} GSM8K prompts x {args.generations} generations, max {args.max_tokens} tokens, "
          f"parallel={not args.plain}, tag scale {args.tag_scale}")
    print(f"{'backend':<13}{'start s':>9}{'gen s':>9}{'tokens':>8}{'sampled':>9}{'tok/s':>9}"
          f"{'blocks/rollout':>16}{'vs transformers':>17}")
    baseline = next((r["tokens_per_s"] for r in results if r["backend"] == "transformers"), None)
    for r in results:
        ratio = f"{r['tokens_per_s'] / baseline:.2f}x" if baseline else "n/a"
        print(f"{r['backend']:<13}{r['startup_s']:>9.1f}{r['seconds']:>9.1f}{r['tokens']:>8}{r['sampled']:>9}"
              f"{r['tokens_per_s']:>9.1f}{r['blocks_per_rollout']:>16.2f}{ratio:>17}")
    if set(args.backends) - set(backends):
        print("vllm: not installed, skipped")
    os.makedirs("metrics/bench", exist_ok=True)
    with open("metrics/bench/rollout_throughput.json", "w", encoding="utf-8") as handle:
        json.dump(dict(args=vars(args), results=results), handle, indent=2)


if __name__ == "__main__":
    main()
