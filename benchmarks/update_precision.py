"""A GRPO update's forward + backward in float32 against bf16 autocast, in one process.

`training.grpo.train_rl` keeps float32 master weights and trains under bf16 autocast on a GPU only; on a
CPU, even one with bf16 units, it trains in float32. This measures the plain part of that choice: one
micro-batch of the small profile's shape (`rl.per_device_batch_size` 4 completions of prompt + 320 tokens)
through the policy with its causal mask, token log-probs, backward; alternating precisions so that both
see the same machine state. The pipeline's Unseen update adds the path-window mask, where autocast gained
far less (docs/benchmarks.md, "GRPO"). Prints the times and the ratio; writes
metrics/bench/update_precision.json.

    python benchmarks/update_precision.py                          # models/base (dvc repro prepare_model)
    python benchmarks/update_precision.py --model models/sft_unseen --rows 4 --tokens 640
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parallel_r1.errors import PipelineError  # noqa: E402
from parallel_r1.models import load_model  # noqa: E402


def update_seconds(model, ids: torch.Tensor, autocast: bool) -> float:
    """One forward + backward of the mean token log-prob, as GRPO's loss reads the logits."""
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits[:, :-1].float()
        logprob = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).mean()
    logprob.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/base")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=640)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    try:
        model, _ = load_model(args.model, dtype="float32")
    except PipelineError as error:  # e.g. models/base before `dvc repro prepare_model`
        raise SystemExit(f"error: {error}") from None
    model.train()
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.rows, args.tokens))
    update_seconds(model, ids, False), update_seconds(model, ids, True)  # warm-up
    times: dict[str, list[float]] = {"float32": [], "bf16_autocast": []}
    for _ in range(args.repeats):
        times["float32"].append(update_seconds(model, ids, False))
        times["bf16_autocast"].append(update_seconds(model, ids, True))
    best = {name: min(values) for name, values in times.items()}
    ratio = best["float32"] / best["bf16_autocast"]
    print(f"{args.rows} x {args.tokens} tokens, {args.model}: float32 {best['float32']:.2f} s, bf16 autocast "
          f"{best['bf16_autocast']:.2f} s (best of {args.repeats}); float32 / autocast = {ratio:.2f}")
    out = ROOT / "metrics" / "bench" / "update_precision.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "rows": args.rows, "tokens": args.tokens,
                               "threads": torch.get_num_threads(), "seconds": times, "ratio": ratio,
                               "cpu_count": os.cpu_count()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
