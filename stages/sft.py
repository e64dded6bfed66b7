"""Stage `sft@<variant>`: cold-start SFT on Parallel-GSM8K (docs/paper.md stage 3), Seen or Unseen.

    dvc repro sft@seen                # or sft@unseen
    python -m stages.sft seen --data data/sft/parallel_gsm8k.jsonl --base models/base   # the same, directly
    accelerate launch --config_file configs/<x>.yaml -m stages.sft unseen   # several GPUs / nodes

Seen trains with causal attention, Unseen with the path-window mask and multiverse position ids
(`parallel_r1.structure`). Reads the base model and the SFT set that dvc.yaml names on the command
line (default: models/base and the filter's data/sft/parallel_<filter.sft_dataset>.jsonl); writes
models/sft_<variant> (safetensors + tokenizer), metrics/sft/<variant>/loss.json (per update: step,
loss, lr, grad_norm; a DVC plot) and metrics/sft/<variant>/summary.json (final loss, steps, examples,
tokens, wall time, and the parallel-block rate of the SFT model's own greedy generations on held-out
GSM8K test questions, with examples). Checkpoints go to checkpoints/sft_<variant>/ every
`sft.save_steps`; re-running a killed run resumes from the last one.
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext

from parallel_r1 import tracking
from parallel_r1.config import from_mapping
from parallel_r1.data import load_problems
from parallel_r1.io import publish_together, read_jsonl
from parallel_r1.training.probe import probe_parallel_blocks
from parallel_r1.training.sft import VARIANTS, SFTOptions, train_sft
from stages.common import is_main_process, load_params, log, section, stage_main

PROBE_SET = "gsm8k_test"  # held out: SFT trains on GSM8K train questions


def sft_options(params: dict, variant: str) -> SFTOptions:
    """`sft` (both variants) + `sft_variants.<variant>` (this variant's steps) + the run's seed."""
    shared, own = section(params, "sft"), section(params, "sft_variants", variant) or {}
    values = {**shared, **own, "variant": variant, "seed": int(params.get("seed", 0))}
    return from_mapping(SFTOptions, values, f"params.yaml sft_variants.{variant}",
                        origins={key: "params.yaml sft" for key in shared if key not in own})


@stage_main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.sft", description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=VARIANTS)
    parser.add_argument("--data", help="the SFT set (default: data/sft/parallel_<filter.sft_dataset>.jsonl)")
    parser.add_argument("--base", default="models/base", help="the model SFT starts from")
    args = parser.parse_args(argv)
    variant = args.variant
    params = load_params()
    # dvc.yaml always passes --data; a direct run takes the set the filter writes (FilterConfig's
    # default: gsm8k)
    sft_dataset = (params.get("filter") or {}).get("sft_dataset", "gsm8k")
    sft_data = args.data or f"data/sft/parallel_{sft_dataset}.jsonl"
    options = sft_options(params, variant)
    rows = read_jsonl(sft_data, required=("question", "completion"), allow_empty=True)
    run = tracking.stage_run(stage="sft", config=variant, params=params, tags={"variant": variant}) \
        if is_main_process() else nullcontext()
    with run:
        started = time.perf_counter()
        dtype = str(section(params, "model").get("dtype", "float32"))
        result = train_sft(options, args.base, rows, f"models/sft_{variant}", f"checkpoints/sft_{variant}",
                           dtype=dtype,
                           report_to=tracking.report_to(), where=sft_data)
        if not result.is_main_process:
            return
        train_seconds = time.perf_counter() - started
        mirror = section(params, "data").get("mirror_dir")
        problems = load_problems(PROBE_SET, mirror, options.probe_questions)
        probe = probe_parallel_blocks(result.model_dir, problems, options.probe_max_tokens, variant=variant,
                                      dtype=dtype)
        summary = {
            "variant": variant,
            "profile": params["profile"],
            "processes": result.processes,
            "final_loss": result.final_loss,
            "first_loss": result.loss_history[0]["loss"] if result.loss_history else None,
            "steps": result.steps,
            "examples": result.examples,
            "dataset_tokens": result.dataset_tokens,
            "completion_tokens": result.completion_tokens,
            "trained_tokens_this_run": result.trained_tokens,
            "steps_this_run": result.steps_this_run,
            "resumed_from": result.resumed_from,
            "train_wall_seconds": round(train_seconds, 1),
            "wall_seconds": round(time.perf_counter() - started, 1),
            "probe": {"dataset": PROBE_SET, **probe},
        }
        with publish_together() as outputs:
            outputs.write_json(f"metrics/sft/{variant}/loss.json", result.loss_history)
            outputs.write_json(f"metrics/sft/{variant}/summary.json", summary)
        tracking.log_metrics({"final_loss": result.final_loss,
                              "parallel_block_rate": probe["parallel_block_rate"],
                              "parallel_tag_rate": probe["parallel_tag_rate"],
                              "probe_mean_response_tokens": probe["mean_response_tokens"],
                              "probe_finished_rate": probe["finished_rate"],
                              "probe_accuracy": probe["accuracy"],
                              "wall_seconds": summary["wall_seconds"]})
        tracking.log_model_reference(result.model_dir)
    log.info(f"sft@{variant}: {result.steps} steps on {result.examples} examples, loss "
          f"{summary['first_loss']} -> {result.final_loss}, {summary['wall_seconds']} s; parallel-block rate "
          f"{probe['parallel_block_rate']:.2f}, accuracy {probe['accuracy']:.2f}, finished "
          f"{probe['finished_rate']:.2f} on {probe['questions']} {PROBE_SET} questions -> "
          f"{result.model_dir}")

if __name__ == "__main__":
    main()
