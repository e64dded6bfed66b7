"""How often a model answers a problem set right, and how many GRPO groups would get a reward spread.

GRPO moves a weight only through groups whose rollouts got different rewards, so before a profile trains on
a problem set, this says whether the init models can give the accuracy rewards a signal there (the small
profile's arithmetic levels were chosen with it: docs/rl_small_profile.md). It samples `--generations`
rollouts per question, with the RL rollout settings of params.yaml (`rl`: temperature, top_p, token cap,
paths, blocks) and the model's prompt and rollout mode, and checks them with the rewards' answer rule.

    python benchmarks/reward_spread.py models/sft_unseen data/rl/dapo.jsonl --questions 12
    python benchmarks/reward_spread.py models/base data/rl/gsm8k.jsonl --prompt baseline --plain --seen
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import yaml

from parallel_r1.engine import RolloutConfig, make_engine
from parallel_r1.evaluation import benchmark_jobs, generate_jobs
from parallel_r1.format import is_parallel
from parallel_r1.io import read_jsonl
from parallel_r1.models import load_tokenizer, runs_in_bf16
from parallel_r1.rewards import is_correct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a model folder (models/<name>)")
    parser.add_argument("data", type=Path, help="a problem set: data/rl/<name>.jsonl, data/eval/<name>.jsonl")
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--generations", type=int, default=4, help="rollouts per question (a GRPO group)")
    parser.add_argument("--temperature", type=float, default=None, help="default: params.yaml rl.temperature")
    parser.add_argument("--prompt", choices=("parallel", "baseline"), default="parallel")
    parser.add_argument("--plain", action="store_true", help="no fork at <Parallel> (the GRPO baselines)")
    parser.add_argument("--seen", action="store_true", help="causal decoding (default: structured, Unseen)")
    parser.add_argument("--show", type=int, default=0, help="print this many responses")
    args = parser.parse_args()
    params = yaml.safe_load(Path("params.yaml").read_text(encoding="utf-8"))
    rl = params["rl"]
    dtype = str(params["model"].get("dtype", "float32"))
    config = RolloutConfig(parallel=not args.plain, structured=not args.seen,
                           temperature=rl["temperature"] if args.temperature is None else args.temperature,
                           top_p=float(rl["top_p"]), max_tokens=int(rl["max_completion_tokens"]),
                           num_paths=int(rl["num_paths"]), max_blocks=int(rl["max_blocks"]),
                           seed=int(params.get("seed", 0)))
    problems = read_jsonl(args.data)[:args.questions]
    tokenizer = load_tokenizer(args.model)
    engine = make_engine("transformers", args.model, tokenizer, config,
                         dtype=dtype if runs_in_bf16(dtype) else "float32",
                         max_batch_size=params["evaluate"].get("max_batch_size"))
    started = time.perf_counter()
    samples = generate_jobs(engine, benchmark_jobs(tokenizer, {"set": (problems, args.generations)},
                                                   args.prompt))
    seconds = time.perf_counter() - started
    groups: dict[str, list[bool]] = {}
    for sample in samples:
        groups.setdefault(sample.problem_id, []).append(
            is_correct(sample.response, sample.ground_truth, sample.answer_kind))
    for sample in samples[:args.show]:
        print(f"--- truth {sample.ground_truth}:\n{sample.response}")
    right = sum(sum(group) for group in groups.values())
    spread = sum(1 for group in groups.values() if 0 < sum(group) < len(group))
    parallel = sum(is_parallel(sample.response, "authors") for sample in samples)
    truncated = sum(sample.truncated for sample in samples)
    print(f"{args.model} on {args.data} (T {config.temperature}, {args.prompt} prompt, "
          f"{'plain' if args.plain else 'forking'}, {'seen' if args.seen else 'unseen'}): "
          f"right {right}/{len(samples)}, groups with a spread {spread}/{len(groups)}, "
          f"parallel {parallel}/{len(samples)}, truncated {truncated}/{len(samples)}, {seconds:.0f} s")


if __name__ == "__main__":
    main()
