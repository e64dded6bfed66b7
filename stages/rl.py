"""Stage `rl@<run>`: GRPO with parallel rollouts (docs/paper.md stages 4-7), one params.yaml `rl_runs` entry.

    dvc repro rl@parallel_r1_unseen_s2          # any run name of params.yaml rl_runs
    python -m stages.rl parallel_r1_unseen_s2   # the same, directly
    accelerate launch --config_file configs/<x>.yaml -m stages.rl parallel_r1_seen   # several GPUs / nodes

A run starts from models/<init> and trains on data/rl/<dataset>.jsonl with its reward schedule
(accuracy, R_parallel x R_acc, alternating S2, scaffold, parallel-only), Seen (causal) or Unseen
(structured log-probs), with the Parallel Thinking or the Baseline prompt, forking rollouts at
`<Parallel>` or not (the GRPO baselines). Writes models/<run> (safetensors + tokenizer; the scaffold
run also models/<run>/steps/step-<n>/ every scaffold_curve.every steps, for Figure 4; and
models/<run>/rollout.json: the prompt, variant and forking evaluate@<run> generates with),
metrics/rl/<run>/steps.json (per step: reward, accuracy, parallel ratio, <Parallel> position,
response length, blocks per response, path diversity, reward spread, reward type; a DVC plot) and
metrics/rl/<run>/summary.json (what ran and where it ended: the reports read it) and
metrics/runtime/rl/<run>.json (speed, resume point, reuse: no report reads it, so a resumed run's reports
stay up to date).
Every step is also logged to the MLflow run `rl@<run>` (by the main process only: see tracking.enabled).
Checkpoints go to checkpoints/rl/<run>/
every rl.save_steps; re-running a killed run resumes from the last one.

A run that is the same computation as one already finished (equal init weights by value, prompts, options
but the names, rewards and code: parallel_r1/training/run_memo.py) reuses that run's model, steps and
summary (`reused_from` in its runtime record and as an MLflow tag) instead of training again: in the default
profile grpo_gsm8k_then_dapo is grpo_dapo whenever GRPO on GSM8K got no reward spread.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import time
from pathlib import Path

from parallel_r1 import tracking
from parallel_r1.config import from_mapping
from parallel_r1.errors import PipelineError
from parallel_r1.io import publish_together, read_jsonl
from parallel_r1.models import check_model_dir
from parallel_r1.rewards import SCHEDULE_KNOBS, SHARED_KNOBS, RewardConfig
from parallel_r1.training import run_memo
from parallel_r1.training.grpo import RLOptions, RLResult, train_rl
from stages.common import load_params, log, section, stage_main

PROBLEM_FIELDS = ("id", "question", "ground_truth", "answer_kind")
# Which RLOptions fields each params.yaml section sets (the rest: the stage, or defaults).
RUN_KEYS = ("init", "dataset", "reward", "variant", "prompt", "parallel", "epsilon_high", "snapshots")
DATASET_KEYS = ("batch_size", "num_generations", "max_steps", "mini_batch_size")
# What a run's own entry may also override (its dataset's or `rl`'s value): a profile lets the runs that can
# move on its model train longer and faster than the mechanics checks (conf/profile/small.yaml).
RUN_OVERRIDES = ("max_steps", "lr", "weight_decay", "batch_size", "mini_batch_size")
SHARED_KEYS = tuple(f.name for f in dataclasses.fields(RLOptions)
                    if f.name not in (*RUN_KEYS, *DATASET_KEYS, "run", "seed", "snapshot_every"))
# How the model generates, saved with it: evaluate@<run> reads it from models/<run> (its declared dep)
# instead of params.yaml rl_runs, so an evaluation depends on the model it evaluates and nothing more.
ROLLOUT_RECORD = "rollout.json"


def rl_options(params: dict, run: str) -> RLOptions:
    """The run's options: `rl` (every run), `rl_datasets.<its dataset>` and its own `rl_runs` entry.

    Each section may hold only its own keys (a run entry also RUN_OVERRIDES, which win), so an error
    names the section to fix.
    """
    entry = section(params, "rl_runs", run)
    if not isinstance(entry, dict):
        raise PipelineError(f"params.yaml rl_runs.{run}: expected a mapping, got {entry!r}")
    datasets = section(params, "rl_datasets")
    dataset = entry.get("dataset")
    if dataset not in datasets:
        raise PipelineError(f"params.yaml rl_runs.{run}.dataset: {dataset!r} has no entry in rl_datasets "
                            f"(known: {', '.join(datasets) or 'none'})")
    layers = {f"params.yaml rl_runs.{run}": (entry, (*RUN_KEYS, *RUN_OVERRIDES)),
              f"params.yaml rl_datasets.{dataset}": (datasets[dataset] or {}, DATASET_KEYS),
              "params.yaml rl": (section(params, "rl"), SHARED_KEYS)}
    origins: dict[str, str] = {}
    for where, (values, allowed) in layers.items():
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise PipelineError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(allowed)})")
        for key in values:  # layers run from the winning one (the run's entry) down
            origins.setdefault(key, where)
    values = {**section(params, "rl"), **(datasets[dataset] or {}), **entry, "run": run,
              "seed": int(params.get("seed", 0))}
    every = section(params, "scaffold_curve").get("every")
    if every is not None:
        values["snapshot_every"] = every
        origins["snapshot_every"] = "params.yaml scaffold_curve.every"
    return from_mapping(RLOptions, values, f"params.yaml rl_runs.{run}", origins)


def check_run_names(params: dict) -> None:
    """Every rl_runs entry names an init model, a dataset and a reward schedule that exist, checked before
    DVC starts (`make run`): DVC would delete the run's outputs first and then fail on the missing
    `reward_schedules.<name>` param or `models/<init>` dependency, in words that name neither param."""
    runs = params.get("rl_runs") or {}
    if not runs:
        return
    models = ["base", *(f"sft_{variant}" for variant in params.get("sft_variants") or {}), *runs]
    names = {"init": models, "dataset": list(section(params, "rl_datasets")),
             "reward": list(params.get("reward_schedules") or {})}
    for run, entry in runs.items():
        for key, known in names.items():
            value = (entry or {}).get(key)
            if value not in known or (key == "init" and value == run):
                raise PipelineError(f"params.yaml rl_runs.{run}.{key}: {value!r} is not a known "
                                    f"{'model' if key == 'init' else key} (known: {', '.join(known)})")


def init_folder(params: dict, run: str, init: str) -> Path:
    """models/<init>; a name no stage writes and no folder holds is named by its param path, with the
    names the pipeline's model stages write (prepare_model, sft@<variant>, the other rl_runs)."""
    folder = Path("models") / init
    if not folder.exists():
        known = ["base", *(f"sft_{variant}" for variant in params.get("sft_variants") or {}),
                 *(name for name in section(params, "rl_runs") if name != run)]
        hint = "is not written yet (run its stage first)" if init in known else "names no model"
        raise PipelineError(f"params.yaml rl_runs.{run}.init: {init!r} {hint}: {folder} not found "
                            f"(known: {', '.join(known)})")
    return folder


def reward_config(params: dict, schedule: str) -> RewardConfig:
    """`rewards` (read by every schedule) + `reward_schedules.<schedule>` (read by that schedule only)."""
    shared = section(params, "rewards")
    knobs = section(params, "reward_schedules", schedule) or {}
    for where, values, allowed in (("rewards", shared, SHARED_KNOBS),
                                   (f"reward_schedules.{schedule}", knobs, SCHEDULE_KNOBS[schedule])):
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise PipelineError(f"params.yaml {where}: unknown key {unknown[0]!r} "
                                f"(read here: {', '.join(allowed) or 'none'})")
    return from_mapping(RewardConfig, {**shared, **knobs}, f"params.yaml reward_schedules.{schedule}",
                        origins={key: "params.yaml rewards" for key in shared})


def summarize(run: str, options: RLOptions, result: RLResult) -> dict:
    """metrics/rl/<run>/summary.json: what ran and where it ended, a function of the run's inputs only.

    The reports depend on it, so it holds nothing a resumed, reused or slower run would write differently:
    those facts go to `runtime` (metrics/runtime/rl/<run>.json, which no report reads)."""
    last = result.history[-1] if result.history else {}
    zero_spread = [h.get("frac_reward_zero_std") for h in result.history]  # share of groups without spread
    return {
        "run": run, "init": options.init, "dataset": options.dataset, "reward": options.reward,
        "variant": options.variant, "prompt": options.prompt, "parallel": options.parallel,
        "steps": result.steps, "prompts": result.prompts, "dropped_long_prompts": result.dropped_prompts,
        "rollouts_per_step": options.batch_size * options.num_generations,
        "rollout_backend": result.engine,
        "final_reward": last.get("reward"),
        "final_accuracy": last.get("accuracy"),
        "final_parallel_ratio": last.get("parallel_ratio"),
        # Steps where some prompt's rollouts got different rewards: only those move a weight in GRPO.
        "steps_with_reward_spread": sum(1 for f in zero_spread if f is not None and f < 1),
        "steps_logged": len(result.history),
        "snapshots": result.snapshots,
    }


def runtime(result: RLResult, wall_seconds: float) -> dict:
    """metrics/runtime/rl/<run>.json: how this process ran (speed, resume point, processes)."""
    rate = result.rollout.tokens_per_second
    return {
        "processes": result.processes,
        "steps_this_run": result.steps_this_run, "resumed_from": result.resumed_from, "reused_from": None,
        "wall_seconds": round(wall_seconds, 1),
        "train_seconds": round(result.train_seconds, 1),
        "mean_step_seconds": round(result.train_seconds / result.steps_this_run,
                                   2) if result.steps_this_run else None,
        "rollout_tokens": result.rollout.tokens,
        "rollout_seconds": round(result.rollout.seconds, 2),
        # this process's step time: rollout (engine) / scoring (rewards, log-probs) / update (fwd+bwd+optim)
        "step_time_split": result.step_times,
        # micro-batches whose every advantage was 0: their forward/backward skipped (exactly zero gradient)
        "skipped_micro_batches_this_run": result.skipped_micro_batches,
        # micro-batches whose old log-probs were scored: the later updates' with a spread (InOrderGRPOTrainer)
        "old_logps_scored_micro_batches_this_run": result.old_logps_scored,
        "rollout_tokens_per_s": round(rate, 1) if rate is not None else None,
    }


def runtime_path(run: str) -> str:
    return f"metrics/runtime/rl/{run}.json"


@stage_main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.rl", description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", help="a key of params.yaml rl_runs")
    run = parser.parse_args(argv).run
    params = load_params()
    runs = section(params, "rl_runs")
    if run not in runs:  # the names live in params.yaml: checked here, in one line
        raise PipelineError(f"usage: python -m stages.rl <run> (one of {', '.join(runs)})")
    options = rl_options(params, run)
    rewards = reward_config(params, options.reward)
    init_dir = check_model_dir(init_folder(params, run, options.init))
    data = f"data/rl/{options.dataset}.jsonl"
    rows = read_jsonl(data, required=PROBLEM_FIELDS)
    tags = {tracking.TAG_VARIANT: options.variant, tracking.TAG_REWARD_SCHEDULE: options.reward,
            "dataset": options.dataset, "init": options.init, "prompt": options.prompt,
            "parallel": options.parallel}
    dtype = str(section(params, "model").get("dtype", "float32"))
    started = time.perf_counter()
    model_dir = Path(f"models/{run}")
    with tracking.stage_run("rl", run, params, tags=tags, label=options.reward):
        key = run_memo.run_key(options, rows, init_dir, rewards, dtype)
        reused = run_memo.reuse(key, model_dir) if key is not None else None
        if reused is not None:
            assert key is not None  # reuse is looked up only with a key
            history = reused["history"]
            summary = {**reused["summary"], "profile": params["profile"], "run": run, "init": options.init}
            unmeasured = ("processes", "resumed_from", "mean_step_seconds", "rollout_tokens_per_s")
            ran = {**dict.fromkeys(unmeasured),
                   "steps_this_run": 0, "reused_from": reused["run"],
                   "wall_seconds": round(time.perf_counter() - started, 1)}
            replay_log_history(reused["log_history"])
            tracking.set_tags({"reused_from": reused["run"]})
            shutil.rmtree(f"checkpoints/rl/{run}", ignore_errors=True)  # an earlier, killed attempt's
            log.info(f"rl@{run}: the same run as rl@{reused['run']} (init weights, prompts, options, rewards "
                     f"and code), its model and steps reused ({run_memo.memo_path(key)})")
        else:
            result = train_rl(options, init_dir, rows, model_dir, f"checkpoints/rl/{run}",
                              reward_config=rewards, dtype=dtype, report_to=tracking.report_to(), where=data)
            if not result.is_main_process:
                return
            history = result.history
            summary = {"profile": params["profile"], **summarize(run, options, result)}
            ran = runtime(result, time.perf_counter() - started)
            if key is not None and result.resumed_from is None:
                run_memo.store(key, run, model_dir, result.log_history, history, summary)
        with publish_together() as outputs:
            rollout = {"prompt": options.prompt, "variant": options.variant, "parallel": options.parallel}
            outputs.write_json(model_dir / ROLLOUT_RECORD, rollout)
            outputs.write_json(f"metrics/rl/{run}/steps.json", history)
            outputs.write_json(f"metrics/rl/{run}/summary.json", summary)
            outputs.write_json(runtime_path(run), ran)
        tracking.log_metrics({key: value for key, value in {**ran, **summary}.items()
                              if key in ("mean_step_seconds", "rollout_tokens_per_s", "final_reward",
                                         "final_accuracy", "final_parallel_ratio") and value is not None})
        tracking.log_model_reference(model_dir)
    log.info(f"rl@{run}: {summary['steps']} steps ({ran['steps_this_run']} this run), "
          f"{ran['mean_step_seconds']} s/step, "
          f"rollouts {ran['rollout_tokens_per_s']} tokens/s ({summary['rollout_backend']}); final reward "
          f"{summary['final_reward']}, accuracy {summary['final_accuracy']}, parallel ratio "
          f"{summary['final_parallel_ratio']} -> {model_dir}")


def replay_log_history(log_history: list[dict]) -> None:
    """Log the stored run's Trainer log into this MLflow run as transformers' MLflowCallback did: every
    numeric value of each entry at its optimizer step, under the same sanitised names."""
    for entry in log_history:
        metrics = {re.sub(r"[^0-9A-Za-z_\-\.\ :/]", "_", key): value for key, value in entry.items()
                   if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
        tracking.log_metrics(metrics, step=int(entry.get("step", 0)))


if __name__ == "__main__":
    main()
