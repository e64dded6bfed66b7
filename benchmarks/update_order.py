"""A GRPO step with TRL's shuffled micro-batches against the rollout order, in one process.

`training.update_batches.InOrderGRPOTrainer` keeps each prompt's group together in the update's
micro-batches and scores the old log-probs only for the later updates' micro-batches with a reward spread,
so a group without a spread costs no forward. This runs the first `--steps` step(s) of one params.yaml RL
run (default the S1 comparison, from its init model) both ways, with the same seeds, hence the same first
rollouts, alternating `--repeats` times, and prints rollout / scoring / update seconds and the ratio of
scoring + update. Writes metrics/bench/update_order.json.

    python benchmarks/update_order.py                               # after `dvc repro sft@unseen`
    python benchmarks/update_order.py --run grpo_dapo --repeats 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parallel_r1.io import read_jsonl  # noqa: E402
from parallel_r1.training.grpo import train_rl  # noqa: E402
from parallel_r1.training.update_batches import InOrderGRPOTrainer  # noqa: E402
from stages.common import load_params  # noqa: E402
from stages.rl import init_folder, reward_config, rl_options  # noqa: E402


def one_run(params: dict, run: str, in_order: bool) -> dict:
    options = rl_options(params, run)
    rows = read_jsonl(ROOT / f"data/rl/{options.dataset}.jsonl")
    # the baseline: TRL's own _prepare_inputs (shuffle, old log-probs of every completion)
    order = contextlib.nullcontext() if in_order else \
        mock.patch.object(InOrderGRPOTrainer, "_in_order_applies", lambda self: False)
    with tempfile.TemporaryDirectory(prefix="update_order_") as scratch, order:
        result = train_rl(options, init_folder(params, run, options.init), rows, Path(scratch) / "out",
                          Path(scratch) / "checkpoints", reward_config=reward_config(params, options.reward),
                          dtype=str(params["model"].get("dtype", "float32")))
    return dict(order="rollout" if in_order else "shuffled (TRL)", **result.step_times,
                skipped_micro_batches=result.skipped_micro_batches,
                old_logps_scored=result.old_logps_scored if in_order else "all",  # TRL: every completion
                accuracy=[record.get("accuracy") for record in result.history])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="parallel_r1_unseen_s1", help="a key of params.yaml rl_runs")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    params = load_params()
    params["rl_runs"][args.run] = {**params["rl_runs"][args.run], "max_steps": args.steps}
    results = [one_run(params, args.run, in_order) for _ in range(args.repeats) for in_order in (False, True)]
    print(f"rl@{args.run}, {args.steps} step(s), each order {args.repeats} time(s), alternating")
    print(f"{'order':<16}{'rollout s':>10}{'scoring s':>11}{'update s':>10}{'skipped':>9}{'old scored':>12}")
    for r in results:
        print(f"{r['order']:<16}{r['rollout_seconds']:>10.1f}{r['scoring_seconds']:>11.1f}"
              f"{r['update_seconds']:>10.1f}{r['skipped_micro_batches']:>9}{str(r['old_logps_scored']):>12}")
    cost = {order: sum(r["scoring_seconds"] + r["update_seconds"] for r in results if r["order"] == order)
            for order in ("shuffled (TRL)", "rollout")}
    ratio = cost["shuffled (TRL)"] / cost["rollout"] if cost["rollout"] else float("nan")
    print(f"scoring + update, shuffled / rollout order: {ratio:.2f}x")
    out = ROOT / "metrics" / "bench" / "update_order.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = dict(args=vars(args), results=results, ratio=ratio)
    out.write_text(json.dumps(report, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
