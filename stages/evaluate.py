"""Stage `evaluate@<model>`: every benchmark for one model, with the training rollout engine.

    dvc repro evaluate@parallel_r1_seen
    python -m stages.evaluate parallel_r1_seen
    python -m stages.evaluate --curve scaffold       # Figure 4: the scaffold run's snapshots
    python -m stages.evaluate grpo_dapo.init         # evaluate_init@grpo_dapo: its init, as the run samples

Per benchmark of `evaluate.benchmarks`: k samples per problem at `evaluate.temperature` with the model's
training prompt and rollout mode (parallel forking, structured attention for the Unseen variant), scored by
the training reward's answer checker. Writes metrics/eval/<model>/<benchmark>.json and the samples to
data/samples/<model>/<benchmark>.jsonl. Each run is the MLflow run `evaluate@<model>` with metrics
`<benchmark>.<metric>` (the curve: `scaffold_curve`, one point per step). `<run>.init` evaluates an RL run's
init model (`evaluate.inits`) with the run's prompt and rollout mode, for the held-out check's pair
(parallel_r1/heldout.py): the GRPO baseline samples base with the Baseline prompt, while `evaluate@base` uses
the Parallel Thinking one. Each benchmark's metrics record the prompt and rollout mode they were sampled with.
One process (one engine start) serves all benchmarks of a model: an engine start is a fixed cost per process,
largest with vLLM (docs/benchmarks.md, "Start-up"), so a process per (model, benchmark) would multiply it by
the number of benchmarks.

An evaluation whose weights (by value) and sampling settings match one already run reuses its
samples (parallel_r1/sample_memo.py: an RL run without a reward spread keeps its init's weights).
Otherwise samples are generated resumably (parallel_r1/generation.py: all benchmarks mixed in each engine
call, every finished chunk appended to data/partial/eval/<model>.jsonl, the curve's to
<run>-step-<n>.jsonl), so a killed evaluation resumes where it stopped. The file lies outside the stage's
outputs because DVC deletes those before it re-runs a stage; it is deleted once the outputs are written.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from parallel_r1 import generation, tracking
from parallel_r1.engine import RolloutConfig, engine_for_variant, make_engine, resolve_engine
from parallel_r1.errors import PipelineError
from parallel_r1.evaluation import benchmark_jobs, by_benchmark, sample_to_row, summarize
from parallel_r1.heldout import INIT_SUFFIX
from parallel_r1.identity import identity_stamp, work_identity
from parallel_r1.io import publish_together, read_json, read_jsonl, write_json
from parallel_r1.models import check_model_dir, load_tokenizer, runs_in_bf16
from stages.common import load_params, log, section, stage_main

if TYPE_CHECKING:
    from parallel_r1.prompts import PromptStyle

PROBLEM_FIELDS = ("id", "question", "ground_truth", "answer_kind")
PARTIAL_DIR = Path("data/partial/eval")   # not under data/samples: DVC empties a stage's outs first


def rollout_mode(model: str) -> tuple[PromptStyle, bool, bool]:
    """(prompt style, structured attention, parallel forking) the model was trained with.

    An RL model carries it in models/<run>/rollout.json (written by rl@<run>), so the evaluation
    depends on the model folder only, not on params.yaml rl_runs; base and SFT models are fixed.
    """
    if model in ("base", "sft_seen", "sft_unseen"):
        return "parallel", model == "sft_unseen", True
    record = Path("models") / model / "rollout.json"
    if not record.is_file():
        check_model_dir(record.parent)  # a missing folder says so first
        raise PipelineError(f"{record}: not found (models/{model} is neither base, sft_* nor written by "
                            f"rl@{model})")
    mode = read_json(record)
    return mode["prompt"], mode["variant"] == "unseen", bool(mode["parallel"])


def weights_and_mode(name: str, params: dict) -> tuple[Path, str]:
    """(the weights' folder, the model whose rollout mode samples them) of the evaluation `name`:
    models/<name> itself, or for `<run>.init` the init params.yaml `evaluate.inits` maps <run> to (composed
    from rl_runs; dvc.yaml's evaluate_init@<run> declares it as a dep), sampled as <run> samples."""
    if not name.endswith(INIT_SUFFIX):
        return Path("models") / name, name
    run = name.removesuffix(INIT_SUFFIX)
    init = (section(params, "evaluate").get("inits") or {}).get(run)
    if not init:
        raise PipelineError(f"params.yaml evaluate.inits: no entry for {run!r}, so the evaluation {name} has "
                            f"no init to evaluate")
    return Path("models") / init, run


def partial_path(model: str, folder: Path) -> Path:
    """Where the evaluation of `folder` keeps its finished chunks: <model>.jsonl, or <run>-step-<n>.jsonl."""
    return PARTIAL_DIR / (f"{model}.jsonl" if folder.name == model else f"{model}-{folder.name}.jsonl")


def stamp(folder: Path, prompt: str, config: RolloutConfig, dtype: str, engine: str) -> str:
    """The partial samples' stamp: the identity of this evaluation (`identity.work_identity`: the
    checkpoint's files and the sampling settings, engine included -- vLLM decodes Unseen summaries
    causally), so a kill, then a retrained model or new settings, never reuses old samples."""
    settings = {"prompt": prompt, "config": dataclasses.asdict(config), "dtype": dtype, "engine": engine}
    return identity_stamp(work_identity(folder, settings))


def evaluate_folder(model: str, folder: Path, benchmarks: dict[str, int], params: dict,
                    sampled_as: str | None = None) -> dict[str, tuple]:
    """{benchmark: (metrics, sample rows)} for the checkpoint in `folder`, resuming from its partial file,
    sampled with the rollout mode of `sampled_as` (default: `model`)."""
    settings = section(params, "evaluate")
    prompt, structured, parallel = rollout_mode(sampled_as or model)
    problems = {name: read_jsonl(f"data/eval/{name}.jsonl", required=PROBLEM_FIELDS) for name in benchmarks}
    check_model_dir(folder)
    tokenizer = load_tokenizer(folder)
    config = RolloutConfig(parallel=parallel, structured=structured,
                           temperature=float(settings["temperature"]),
                           top_p=float(settings["top_p"]), max_tokens=int(settings["max_tokens"]),
                           num_paths=int(settings["num_paths"]), max_blocks=int(settings["max_blocks"]),
                           seed=int(params.get("seed", 0)))
    dtype = str(section(params, "model").get("dtype", "float32"))
    dtype = dtype if runs_in_bf16(dtype) else "float32"

    engine = engine_for_variant(settings.get("engine", "auto"), settings.get("unseen_engine", "same"),
                                structured)

    def start_engine():
        return make_engine(engine, folder, tokenizer, config, dtype=dtype,
                           gpu_memory_utilization=settings.get("gpu_memory_utilization"),
                           enforce_eager=settings.get("enforce_eager"),
                           max_batch_size=settings.get("max_batch_size"),
                           memory_param="params.yaml evaluate.gpu_memory_utilization")

    jobs = benchmark_jobs(tokenizer, {name: (problems[name], k) for name, k in benchmarks.items()}, prompt)
    kind = resolve_engine(engine)
    memo_settings = {"prompt": prompt, "config": dataclasses.asdict(config), "dtype": dtype, "engine": kind,
                     "gpu_memory_utilization": settings.get("gpu_memory_utilization"),
                     "enforce_eager": settings.get("enforce_eager"),
                     # the rows decoded together set the matmul shapes, which change the logits' last bits
                     "max_batch_size": settings.get("max_batch_size") if kind == "transformers" else None}
    run_stamp = stamp(folder, prompt, config, dtype, kind)
    samples = generation.memoised_samples(folder, jobs, memo_settings, run_stamp, start_engine,
                                          partial_path(model, folder), f"evaluate {model}", log)
    checker = settings.get("checker", "paper")
    results = {}
    for name, generated in by_benchmark(jobs, samples, benchmarks).items():
        k = benchmarks[name]
        metrics = summarize(generated, k, model=model, benchmark=name, profile=params["profile"],
                            checker=checker, tokenizer=tokenizer)
        metrics.update(prompt=prompt, variant="unseen" if structured else "seen",
                       parallel_rollout=parallel)   # heldout.ROLLOUT_KEYS: what a paired check compares
        results[name] = (metrics, [sample_to_row(s, checker, tokenizer) for s in generated])
        log.info(f"{model} {name}: mean@{k} {metrics['mean_at_k']:.3f}, pass@{k} {metrics['pass_at_k']:.3f}, "
                 f"parallel {metrics['parallel_ratio']:.2f}, truncated {metrics['truncated']}/"
                 f"{metrics['n_samples']}")
    return results


def benchmark_ks(params: dict) -> dict[str, int]:
    ks = {}
    for name, spec in section(params, "evaluate", "benchmarks").items():
        k = spec.get("k") if isinstance(spec, dict) else None
        if not isinstance(k, int) or k < 1:
            raise PipelineError(f"params.yaml evaluate.benchmarks.{name}.k: must be an integer >= 1, got "
                                f"{k!r}")
        ks[name] = k
    return ks


def tracked_metrics(benchmark: str, metrics: dict) -> dict[str, float]:
    """The numeric metrics of one benchmark as `<benchmark>.<metric>` for MLflow."""
    return {f"{benchmark}.{key}": value for key, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def model_tags(model: str, params: dict) -> dict[str, str | None]:
    """Variant and reward schedule of the model, so MLflow can group evaluations like RL runs (an init
    evaluated as its run samples gets the run's variant and prompt, and no schedule: it was not trained)."""
    run = params.get("rl_runs", {}).get(model, {})   # a tag only: MLflow grouping, not an output
    prompt, structured, parallel = rollout_mode(weights_and_mode(model, params)[1])
    return {tracking.TAG_VARIANT: "unseen" if structured else "seen",
            tracking.TAG_REWARD_SCHEDULE: run.get("reward"),
            "prompt": prompt, "parallel_rollout": str(parallel).lower()}


def evaluate_model(model: str, params: dict) -> None:
    folder, sampled_as = weights_and_mode(model, params)
    stage, key = ("evaluate_init", sampled_as) if sampled_as != model else ("evaluate", model)  # DVC's name
    with tracking.stage_run(stage, key, params, tags=model_tags(model, params)):
        results = evaluate_folder(model, folder, benchmark_ks(params), params, sampled_as)
        with publish_together() as outputs:   # every benchmark's metrics and samples, or none
            for name, (metrics, rows) in results.items():
                outputs.write_json(f"metrics/eval/{model}/{name}.json", metrics)
                outputs.write_jsonl(f"data/samples/{model}/{name}.jsonl", rows)
        for name, (metrics, _) in results.items():
            tracking.log_metrics(tracked_metrics(name, metrics))
        partial_path(model, folder).unlink(missing_ok=True)
        tracking.log_model_reference(folder)


def evaluate_curve(run: str, params: dict) -> None:
    """Figure 4: one benchmark over the run's step snapshots (models/<run>/steps/step-<n>)."""
    curve = section(params, "scaffold_curve")
    benchmark = curve.get("benchmark", "aime25")
    k = benchmark_ks(params)[benchmark]
    snapshots = sorted((Path("models") / run / "steps").glob("step-*"),
                       key=lambda p: int(p.name.split("-")[1]))
    if not snapshots:
        raise PipelineError(f"models/{run}/steps: no step snapshots to evaluate (did rl@{run} export them?)")
    points = []
    # DVC: scaffold_curve
    with tracking.stage_run(f"{run}_curve", params=params, tags=model_tags(run, params)):
        for folder in snapshots:
            step = int(folder.name.split("-")[1])
            metrics, _ = evaluate_folder(run, folder, {benchmark: k}, params)[benchmark]
            points.append({"step": step, "mean_at_k": metrics["mean_at_k"],
                           "pass_at_k": metrics["pass_at_k"], "parallel_ratio": metrics["parallel_ratio"]})
            tracking.log_metrics(tracked_metrics(benchmark, metrics), step=step)
    switch_step = section(params, "reward_schedules", "scaffold", "switch_step")
    write_json(f"metrics/curves/{run}.json", {"benchmark": benchmark, "k": k, "profile": params["profile"],
                                              "switch_step": switch_step,
                                              "points": points})
    for folder in snapshots:   # kept until now: a killed curve resumes without redoing finished snapshots
        partial_path(run, folder).unlink(missing_ok=True)


@stage_main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="model folder name under models/, <run>.init for a run's init as the "
                                      "run samples, or the run with --curve")
    parser.add_argument("--curve", action="store_true", help="evaluate the run's step snapshots (Figure 4)")
    args = parser.parse_args(argv)
    params = load_params()
    if args.curve:
        evaluate_curve(args.model, params)
    else:
        evaluate_model(args.model, params)


if __name__ == "__main__":
    main()
