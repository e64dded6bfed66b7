"""Where an RL step's time goes: rollout / scoring / update, from tiny GRPO runs measured in one process.

Runs the project's GRPO (`training.grpo.train_rl`, the code path of `stages.rl`) for `--steps` steps
of a tiny random-init Qwen3 (the tiny profile's size, real Qwen3 vocabulary) on GSM8K test questions,
Seen and Unseen, with parallel rollouts. The fork tags' embedding rows are scaled (`--tag-scale`) so
that the random model forks. The trainer's `StepTimes` splits each run's time into

  rollout  the rollout engine (KV-forking transformers backend by default; `--engine vllm` too);
  scoring  the rest of TRL's `_generate_and_score_completions`: rewards, old/reference log-probs
           (Unseen: under the path-window mask), advantages;
  update   forward, backward and optimizer step (`training_step` less the two).

Shares are of the run's summed step time, so runs and machines can be compared; `rl.*` params come
from params.yaml's tiny profile, sizes from the flags. Prints one table and writes
metrics/bench/rl_step.json.

    python benchmarks/rl_step.py
    python benchmarks/rl_step.py --steps 3 --generations 4 --max-tokens 96
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from rollout_throughput import GSM8K_TEST, fork_prone_model  # noqa: E402

from parallel_r1.rewards import RewardConfig  # noqa: E402
from parallel_r1.training.grpo import train_rl  # noqa: E402
from stages.profiles import compose  # noqa: E402
from stages.rl import rl_options  # noqa: E402


def run_split(variant: str, folder: str, rows: list[dict], args) -> dict:
    params = compose(ROOT, "tiny")
    params["rl"] = {**params["rl"], "max_completion_tokens": args.max_tokens, "engine": args.engine,
                    "save_steps": args.steps + 1, "lr": 1.0e-4}
    params["rl_datasets"] = {"gsm8k": {"batch_size": args.prompts, "mini_batch_size": args.prompts,
                                       "num_generations": args.generations, "max_steps": args.steps}}
    params["rl_runs"] = {"bench": {"init": "base", "dataset": "gsm8k", "reward": "parallel_only",
                                   "variant": variant, "prompt": "parallel", "parallel": True}}
    options = rl_options(params, "bench")
    with tempfile.TemporaryDirectory(prefix="rl_step_") as scratch:
        result = train_rl(options, folder, rows, Path(scratch) / "out", Path(scratch) / "checkpoints",
                          reward_config=RewardConfig())
    split = result.step_times
    total = sum(split.values())
    return dict(variant=variant, engine=result.engine, steps=result.steps_this_run,
                rollout_tokens=result.rollout.tokens, total_s=total, **split,
                **{key.replace("_seconds", "_share"): value / total for key, value in split.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--generations", type=int, default=4, help="rollouts per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tag-scale", type=float, default=30.0)
    parser.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    parser.add_argument("--variants", nargs="+", default=["seen", "unseen"], choices=["seen", "unseen"])
    args = parser.parse_args()
    with open(GSM8K_TEST, encoding="utf-8") as source:
        rows = [dict(json.loads(line), answer_kind="gsm8k", dataset="gsm8k_test")
                for _, line in zip(range(4 * args.prompts), source, strict=False)]
    with tempfile.TemporaryDirectory(prefix="rl_step_model_") as folder:
        fork_prone_model(folder, args.tag_scale)
        results = [run_split(variant, folder, rows, args) for variant in args.variants]
    print(f"RL step split: tiny Qwen3, {args.steps} steps x {args.prompts} prompts x {args.generations} "
          f"rollouts, <= {args.max_tokens} tokens, parallel_only reward, engine {args.engine}")
    print(f"{'variant':<9}{'total s':>9}{'rollout s':>11}{'scoring s':>11}{'update s':>10}"
          f"{'rollout':>9}{'scoring':>9}{'update':>8}")
    for r in results:
        print(f"{r['variant']:<9}{r['total_s']:>9.2f}{r['rollout_seconds']:>11.2f}{r['scoring_seconds']:>11.2f}"
              f"{r['update_seconds']:>10.2f}{r['rollout_share']:>9.0%}{r['scoring_share']:>9.0%}"
              f"{r['update_share']:>8.0%}")
    os.makedirs(ROOT / "metrics" / "bench", exist_ok=True)
    with open(ROOT / "metrics" / "bench" / "rl_step.json", "w", encoding="utf-8") as handle:
        json.dump(dict(args=vars(args), results=results), handle, indent=2)


if __name__ == "__main__":
    main()
