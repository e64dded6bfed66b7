"""Stage `heldout`: init vs final model of the RL runs that can move on the profile's model, per question.

    dvc repro heldout
    python -m stages.heldout

For each run of params.yaml `reports.heldout_runs`, its init model's and its final model's samples on
`reports.heldout_benchmark` (`data/samples/<model>/<benchmark>.jsonl`, written by evaluate@<model> with the
same prompts and sampler seeds; for a run listed in `evaluate.inits`, the init's evaluation as the run
samples, `<run>.init`, by evaluate_init@<run>; metrics/eval/ says each one's prompt and rollout mode, which
must match) are paired per question: parallel ratio, path diversity, 1 − self-BLEU of the paths, 1 − self-BLEU
of any closed block and accuracy, final − init, with a 95% percentile bootstrap interval over the questions
(parallel_r1/heldout.py). Writes reports/heldout.md and metrics/heldout.json (a DVC metric). A stage of its
own, not a branch of stages.reports: it reads evaluations (samples and how they were sampled), not the
reports' metric files, and its code deps stay its own.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from parallel_r1 import heldout, reports, tracking
from parallel_r1.config import from_mapping
from parallel_r1.errors import PipelineError
from parallel_r1.io import read_json, read_jsonl, write_json
from stages.common import load_params, log, stage_main

OUTPUT = Path("reports/heldout.md")
METRICS = Path("metrics/heldout.json")
SAMPLES = Path("data/samples")
METRICS_DIR = Path("metrics/eval")   # each evaluation's prompt and rollout mode: the pairs must match


def build(params: dict) -> Path:
    """Read the runs' samples, compare each final model with its init and write the report and metrics."""
    options = from_mapping(reports.ReportOptions, params.get("reports", {}), "params.yaml reports")
    runs = params.get("rl_runs", {})
    bench = options.heldout_benchmark
    evaluate = params.get("evaluate") or {}
    as_run = set(evaluate.get("inits") or [])   # inits evaluated as their run samples (evaluate_init@<run>)
    results, inits = {}, {}
    for run in options.heldout_runs:
        if run not in runs:
            raise PipelineError(f"params.yaml reports.heldout_runs: {run!r} is not an rl_runs entry")
        init = runs[run]["init"]
        paired = run + heldout.INIT_SUFFIX if run in as_run else init
        inits[run] = f"`{init}` as `{run}` samples" if run in as_run else f"`{init}`"
        evaluated = evaluate.get("models")
        if evaluated is not None and (missing := [m for m in (init, run) if m not in evaluated
                                                  and not (m == init and run in as_run)]):
            raise PipelineError(f"params.yaml reports.heldout_runs: {run!r} needs evaluations of "
                                f"{' and '.join(missing)}, which evaluate.models does not list")
        init_metrics, final_metrics = (METRICS_DIR / model / f"{bench}.json" for model in (paired, run))
        heldout.same_rollout(read_json(init_metrics), read_json(final_metrics),
                             (str(init_metrics), str(final_metrics)), run)
        init_path, final_path = (SAMPLES / model / f"{bench}.jsonl" for model in (paired, run))
        results[run] = heldout.compare(read_jsonl(init_path, required=("problem_id", "response")),
                                       read_jsonl(final_path, required=("problem_id", "response")),
                                       int(params.get("seed", 0)), (str(init_path), str(final_path)))
    write_json(METRICS, heldout.as_json(results))
    reports.write_markdown(OUTPUT, heldout.markdown(results, inits, bench, reports.banner(params["profile"])))
    return OUTPUT


@stage_main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.heldout", description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    params = load_params()
    with tracking.stage_run("heldout", params=params):
        out = build(params)
        tracking.log_artifact(out)
    log.info(f"wrote {out}")


if __name__ == "__main__":
    main()
