"""Reward schedules side by side: reports/reward_schedules.md and .png, the schedules the paper
compares (§4.3-4.5): accuracy-only, parallel-only, alternating (S2) and scaffold, and the diversity-aware
parallel reward of the authors' released code (beyond the paper's tables).

The DVC stage builds it from the RL runs' own files (`runs_from_metrics`: metrics/rl/<run>/steps.json
and summary.json, declared deps), so it is rebuilt exactly when a run changes and needs no
tracking server. `collect_curves` reads the same step histories from the MLflow runs instead
(every finished RL run tagged with a schedule, several seeds giving several lines), for comparing
sweeps that DVC does not track; a run read from MLflow links to its page in the UI:

    .venv/bin/python -m parallel_r1.reward_schedule_report   # -> reports/reward_schedules_mlflow.{md,png}
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from parallel_r1 import mlflow_ui, tracking
from parallel_r1.errors import PipelineError
from parallel_r1.io import atomic_path

# Schedule name (the `reward` of an rl_runs entry) -> label in the report, in display order.
SCHEDULES = {
    "accuracy": "accuracy-only",
    "parallel_only": "parallel-only",
    "parallel_diversity": "parallel + diversity (beyond the paper's tables)",
    "alternating": "alternating (S2)",
    "scaffold": "scaffold (S2, then accuracy-only)",
}
# Curve -> MLflow metric key the RL trainer logs it under. TRL logs the total reward as `reward`
# and each reward function as `rewards/<function>/mean`; change the right-hand side to match.
METRICS = {
    "reward": "reward",
    "accuracy": "accuracy",
    "parallel_ratio": "parallel_ratio",
    "path_diversity": "path_diversity",
}
RL_STAGE = "rl"


@dataclass
class RunCurves:
    """One RL run: its schedule, its page in the MLflow UI and, per curve name, (step, value)
    points sorted by step."""

    run_id: str
    name: str
    schedule: str
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    url: str = ""


def collect_curves(params: Mapping[str, Any] | None = None, stage: str = RL_STAGE) -> list[RunCurves]:
    """Finished runs of `stage` tagged with a schedule of SCHEDULES, with their metric histories.

    Only the latest run per run name and DVC experiment counts (a rerun replaces the earlier
    one; sweep experiments, e.g. seeds, stay apart). MLflow location and experiment as
    `tracking` resolves them (env, then params `tracking.*`).
    """
    from mlflow import MlflowClient

    uri = tracking.tracking_uri(params)
    name = tracking.experiment_name(params)
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(name)
    if found is None:
        raise PipelineError(f"MLflow {uri}: no experiment {name!r} (run the RL stages with tracking on)")
    runs = []
    for schedule in SCHEDULES:
        query = (f"tags.{tracking.TAG_STAGE} = '{stage}' and tags.{tracking.TAG_REWARD_SCHEDULE} = "
                 f"'{schedule}' and attributes.status = 'FINISHED'")
        latest: dict[str, Any] = {}
        for run in client.search_runs([found.experiment_id], filter_string=query,
                                      order_by=["attributes.start_time DESC"]):
            label = run.info.run_name or run.info.run_id
            if run.data.tags.get(tracking.TAG_DVC_EXP):
                label += f" [{run.data.tags[tracking.TAG_DVC_EXP]}]"
            latest.setdefault(label, run)
        for label, run in sorted(latest.items()):
            curves = {curve: _history(client, run.info.run_id, key) for curve, key in METRICS.items()}
            url = mlflow_ui.run_url(mlflow_ui.base_url(uri), found.experiment_id, run.info.run_id)
            runs.append(RunCurves(run.info.run_id, label, schedule, curves, url))
    if not runs:
        raise PipelineError(f"MLflow {uri} experiment {name!r}: no finished {stage!r} runs tagged "
                            f"{tracking.TAG_REWARD_SCHEDULE} in {sorted(SCHEDULES)}")
    return runs


RunMetrics = tuple[Mapping[str, Any], list[Mapping[str, Any]]]   # a run's (summary.json, steps.json)


def runs_from_metrics(metrics: Mapping[str, RunMetrics]) -> list[RunCurves]:
    """RunCurves from each run's (summary.json, steps.json): the schedule is the summary's `reward`.

    Runs on a schedule this report does not compare are an error naming the run, not a silent gap.
    """
    runs = []
    for name, (summary, steps) in metrics.items():
        schedule = summary.get("reward")
        if schedule not in SCHEDULES:
            raise PipelineError(f"metrics/rl/{name}/summary.json: reward {schedule!r} is not a compared "
                                f"schedule ({', '.join(SCHEDULES)})")
        curves = {curve: [(int(row["step"]), float(row[curve])) for row in steps
                          if row.get(curve) is not None] for curve in METRICS}
        runs.append(RunCurves(run_id=name, name=f"rl@{name}", schedule=schedule, curves=curves))
    runs.sort(key=lambda run: (list(SCHEDULES).index(run.schedule), run.name))
    return runs


def markdown(runs: list[RunCurves], source: str, plot_name: str = "reward_schedules.png") -> str:
    """A table: one row per run with the first → last and the best value of each curve."""
    header = ["schedule", "run", "steps", *(f"{curve} first → last" for curve in METRICS),
              *(f"best {curve}" for curve in METRICS)]
    lines = ["# Reward schedules", "",
             f"RL runs from {source}, compared over steps (rollout batches); "
             f"curves in `{plot_name}`. Metric keys: "
             + ", ".join(f"{curve} = `{key}`" for curve, key in METRICS.items()) + ".", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        steps = max((len(points) for points in run.curves.values()), default=0)
        last = [f"{_fmt(points[0][1])} → {_fmt(points[-1][1])}" if points else _fmt(None)
                for points in run.curves.values()]
        best = [_fmt(max((value for _, value in points), default=None)) for points in run.curves.values()]
        name = f"[{run.name}]({run.url})" if run.url else run.name
        lines.append("| " + " | ".join([SCHEDULES[run.schedule], name, str(steps), *last, *best]) + " |")
    missing = [label for schedule,
               label in SCHEDULES.items() if not any(run.schedule == schedule for run in runs)]
    if missing:
        lines += ["", f"No run of these schedules in this comparison (none finished, or none listed): "
                      f"{', '.join(missing)}."]
    return "\n".join(lines) + "\n"


def plot(runs: list[RunCurves], path: str | os.PathLike) -> None:
    """One panel per curve, one line per run, one colour per schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from parallel_r1.reports import whole_step_axis

    colours = dict(zip(SCHEDULES, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    fig, axes = plt.subplots(1, len(METRICS), figsize=(5 * len(METRICS), 3.8), squeeze=False)
    for axis, curve in zip(axes[0], METRICS, strict=True):
        for run in runs:
            points = run.curves.get(curve) or []
            if points:
                steps, values = zip(*points, strict=True)
                axis.plot(steps, values, color=colours[run.schedule], marker=".",
                          label=f"{SCHEDULES[run.schedule]}: {run.name}")
        axis.set_title(curve)
        axis.set_xlabel("step")
        whole_step_axis(axis)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def write_report(runs: list[RunCurves], markdown_path: str | os.PathLike, plot_path: str | os.PathLike,
                 source: str) -> None:
    """The markdown table and the plot of `runs`; `source` says where their curves came from."""
    plot(runs, plot_path)
    with atomic_path(markdown_path) as tmp:
        Path(tmp).write_text(markdown(runs, source, Path(plot_path).name), encoding="utf-8")


def build_report(markdown_path: str | os.PathLike, plot_path: str | os.PathLike,
                 params: Mapping[str, Any] | None = None, stage: str = RL_STAGE) -> list[RunCurves]:
    """Write the markdown table and the plot; returns the runs they show."""
    runs = collect_curves(params, stage)
    plot(runs, plot_path)
    source = (f"experiment `{tracking.experiment_name(params)}`; each run links to its page in the MLflow UI "
              f"at {mlflow_ui.base_url(tracking.tracking_uri(params))} (`make ui`), where the filter "
              f"`{mlflow_ui.RL_RUNS_FILTER}` grouped by tag `{tracking.TAG_REWARD_SCHEDULE}` shows them all")
    with atomic_path(markdown_path) as tmp:
        Path(tmp).write_text(markdown(runs, source, Path(plot_path).name), encoding="utf-8")
    return runs


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    by_step: dict[int, tuple[int, float]] = {}
    for metric in client.get_metric_history(run_id, key):
        if metric.step not in by_step or metric.timestamp >= by_step[metric.step][0]:
            by_step[metric.step] = (metric.timestamp, metric.value)
    return [(step, value) for step, (_, value) in sorted(by_step.items())]


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> None:
    """The comparison from MLflow (sweeps and seeds included): one line and exit 1 when there is nothing."""
    import yaml

    parser = argparse.ArgumentParser(prog="python -m parallel_r1.reward_schedule_report",
                                     description="Reward schedules side by side, from the MLflow runs.")
    parser.add_argument("--out", default="reports/reward_schedules_mlflow.md",
                        help="the markdown file; the plot goes beside it (.png)")
    parser.add_argument("--params", default="params.yaml", help="its `tracking` section, if the file exists")
    args = parser.parse_args(argv)
    params_file = Path(args.params)
    params = yaml.safe_load(params_file.read_text(encoding="utf-8")) if params_file.is_file() else None
    out = Path(args.out)
    try:
        runs = build_report(out, out.with_suffix(".png"), params=params)
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    print(f"{out}: {len(runs)} RL runs over {len({run.schedule for run in runs})} reward schedules")


if __name__ == "__main__":
    main()
