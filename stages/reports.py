"""Build one of the paper's tables or figures from the metric files, the paper's numbers beside ours.

    dvc repro table2                       # or any report below, by its stage name
    python -m stages.reports table2        # direct: table1 | table2 | ablation_training | ablation_prompt |
                                           # ablation_reward | figure3 | figure4 | reward_schedules | rl_runs

Each report reads only its own inputs (the tables' deps are all of metrics/eval: which rows a profile
evaluates is its `evaluate.models`, and a row it leaves out reads "not evaluated"):

    table1             metrics/filter/<dataset>.json            -> reports/table1.md
    table2             metrics/eval/<model>/<benchmark>.json    -> reports/table2.md
    ablation_training  (same, for the ablation's models)        -> reports/ablation_training.md
    ablation_prompt    (same)                                   -> reports/ablation_prompt.md
    ablation_reward    (same)                                   -> reports/ablation_reward.md
    figure3            metrics/rl/<run>/steps.json              -> reports/figure3_parallel_position.png
    figure4            metrics/curves/scaffold.json             -> reports/figure4_scaffold.png
    reward_schedules   metrics/rl/<run>/summary.json, steps.json -> reports/reward_schedules.md + .png
    rl_runs            metrics/rl/<run>/summary.json, steps.json -> reports/rl_runs.md

Each build is an MLflow run named like its DVC stage, with the report (and its plot) as
artifacts. Benchmarks are aime25, aime24, amc23 and math (and GSM8K test and the held-out
arithmetic problems where evaluated). params.yaml
keys read: `profile`, and the
optional section `reports` (defaults in `parallel_r1.reports.ReportOptions`):

    reports:
      table1_datasets: [gsm8k, dapo]
      base_model_label: SmolLM2-135M-Instruct     # the profile's base model, named in Table 2's base row
      table2_rows: {qwen3_4b_base: base, parallel_sft_seen: sft_seen, ...}   # paper row -> model
      ablation_training_rows: {parallel_r1_seen: parallel_r1_seen, ...}
      ablation_prompt_rows: {with_prompt: parallel_r1_seen, without_prompt: parallel_r1_seen_without_prompt}
      ablation_reward_rows: {accuracy_only: parallel_r1_unseen_s1,
                             parallel_only: parallel_r1_unseen_parallel_only,
                             alternating: parallel_r1_unseen_s2,
                             parallel_diversity: parallel_r1_unseen_parallel_diversity}
      figure3_runs: [parallel_r1_seen, parallel_r1_unseen_s1, parallel_r1_unseen_s2]
      reward_schedule_runs: [parallel_r1_unseen_s1, parallel_r1_unseen_parallel_only,
                             parallel_r1_unseen_parallel_diversity, parallel_r1_unseen_s2, scaffold]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from parallel_r1 import reports, tracking
from parallel_r1.config import from_mapping
from parallel_r1.io import read_json
from stages.common import load_params, log, stage_main

METRICS = Path("metrics")
REPORTS = Path("reports")
OUTPUTS = {
    "table1": REPORTS / "table1.md",
    "table2": REPORTS / "table2.md",
    "ablation_training": REPORTS / "ablation_training.md",
    "ablation_prompt": REPORTS / "ablation_prompt.md",
    "ablation_reward": REPORTS / "ablation_reward.md",
    "figure3": REPORTS / "figure3_parallel_position.png",
    "figure4": REPORTS / "figure4_scaffold.png",
    "reward_schedules": REPORTS / "reward_schedules.md",
    "rl_runs": REPORTS / "rl_runs.md",
}
ABLATIONS = {
    "ablation_training": (reports.ablation_training, "ablation_training_rows"),
    "ablation_prompt": (reports.ablation_prompt, "ablation_prompt_rows"),
    "ablation_reward": (reports.ablation_reward, "ablation_reward_rows"),
}


def read_eval_metrics(models: list[str]) -> dict[str, dict[str, dict]]:
    """metrics/eval/<model>/<benchmark>.json for the given models: the paper's four benchmarks
    (required) and the extra ones (GSM8K test, arithmetic) where the evaluation wrote them."""
    metrics: dict[str, dict[str, dict]] = {}
    for model in dict.fromkeys(models):
        metrics[model] = {bench: read_json(reports.eval_metrics_path(model, bench, METRICS / "eval"))
                          for bench in reports.BENCHMARKS}
        for bench in reports.EXTRA_BENCHMARKS:
            path = reports.eval_metrics_path(model, bench, METRICS / "eval")
            if path.is_file():
                metrics[model][bench] = read_json(path)
    return metrics


def not_evaluated(rows: dict[str, str], params: dict) -> list[str]:
    """The rows' models that params.yaml `evaluate.models` leaves out (no evaluate@<model> stage); none
    when params.yaml lists no models (every row is then read from its metric files)."""
    evaluated = (params.get("evaluate") or {}).get("models")
    return [] if evaluated is None else [model for model in rows.values() if model not in evaluated]


def build(report: str, params: dict) -> Path:
    """Read the inputs of `report`, build it and write it; returns the output path."""
    options = from_mapping(reports.ReportOptions, params.get("reports", {}), "params.yaml reports")
    profile = params["profile"]
    out = OUTPUTS[report]
    if report == "table1":
        filter_metrics = {d: read_json(METRICS / "filter" / f"{d}.json") for d in options.table1_datasets}
        reports.write_markdown(out, reports.table1(filter_metrics, profile))
    elif report == "table2":
        rows, skipped = options.table2_rows, not_evaluated(options.table2_rows, params)
        metrics = read_eval_metrics([model for model in rows.values() if model not in skipped])
        temperature = (params.get("evaluate") or {}).get("temperature")
        reports.write_markdown(out, reports.table2(metrics, rows, profile, options.base_model_label, skipped,
                                                   temperature=temperature))
    elif report in ABLATIONS:
        build_table, key = ABLATIONS[report]
        rows = getattr(options, key)
        skipped = not_evaluated(rows, params)
        metrics = read_eval_metrics([model for model in rows.values() if model not in skipped])
        reports.write_markdown(out, build_table(metrics, rows, profile=profile, not_evaluated=skipped))
    elif report == "figure3":
        steps = {run: read_json(METRICS / "rl" / run / "steps.json") for run in options.figure3_runs}
        reports.figure3_parallel_position(steps, out, profile=profile)
    elif report == "rl_runs":
        runs = list(params.get("rl_runs", {}))
        summaries = {run: read_json(METRICS / "rl" / run / "summary.json") for run in runs}
        steps = {run: read_json(METRICS / "rl" / run / "steps.json") for run in runs}
        reports.write_markdown(out, reports.rl_runs(summaries, steps, profile))
    elif report == "figure4":
        reports.figure4_scaffold(read_json(METRICS / "curves" / "scaffold.json"), out, profile=profile)
    else:
        from parallel_r1 import reward_schedule_report as schedules

        folders = {run: METRICS / "rl" / run for run in options.reward_schedule_runs}
        schedule_runs = {run: (read_json(folder / "summary.json"), read_json(folder / "steps.json"))
                         for run, folder in folders.items()}
        schedules.write_report(schedules.runs_from_metrics(schedule_runs), out, out.with_suffix(".png"),
                               source="metrics/rl/<run>/steps.json")
    return out


@stage_main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.reports", description=__doc__.splitlines()[0])
    parser.add_argument("report", choices=sorted(OUTPUTS))
    args = parser.parse_args(argv)
    params = load_params()
    with tracking.stage_run(args.report, params=params):  # the run is named like the DVC stage
        out = build(args.report, params)
        tracking.log_artifact(out)
        if args.report == "reward_schedules":  # the comparison comes with its plot
            tracking.log_artifact(out.with_suffix(".png"))
    log.info(f"wrote {out}")


if __name__ == "__main__":
    main()
