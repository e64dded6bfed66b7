"""Prefect flow `sweep`: RL configurations x reward schedules x seeds as DVC experiments.

    python -m flows.sweep parallel_r1_unseen_s1 --reward-schedules accuracy alternating --seeds 1 2
    python -m flows.sweep --target prepare_data --grid data.eval.aime24.limit=1,2   # any stage

    python -m flows.sweep ... --pool parallel-r1    # every experiment on the pool's workers at once

On one machine (no pool), each combination is one `dvc exp run --temp --name <name> -S <param>=<value>
... <target>`: `--temp` runs it in a temporary clone, so the workspace stays as it is and every experiment is
kept under its name (`dvc exp show`, `dvc exp apply <name>`). They run one after another as
Prefect tasks, each with its own MLflow run (parent of its stage runs) — the reason for `--temp`
over `--queue` + `dvc queue start`: queue workers are long-lived daemons that outlive a sweep
with their environment frozen, so a per-experiment parent run id cannot reach them.
With `pool`, each combination is a flow run of the deployment `experiment/<pool>` (flows/experiment.py,
flows/workpool.py), run by whichever worker of the pool is free, on any machine with a clone: the sweep
pushes its commit to the git remote, launches them all, waits, and reads each one's row back; the
experiments come back as git refs (`dvc exp pull origin`) with their data in the DVC remote.
The flow ends with a comparison table (Prefect table artifact) and a markdown link to MLflow.

Parameter paths set per combination: `rl_runs.<configuration>.reward`, `seed`, `profile`, and
each `grid` key; the default target is `rl@<configuration>`.
Experiments run from the last commit plus the workspace's changes to tracked files (on a pool: from the
last commit, and changes to tracked files are refused).
"""

from __future__ import annotations

import argparse
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from flows import workpool
from flows.dvc_runner import DvcCommandError, dvc_json, experiment_metrics, run_dvc
from flows.remote import push_baseline, unique_id
from flows.reproduce import CRASH_RETRIES, retry_only_transient
from parallel_r1 import tracking
from parallel_r1.errors import PipelineError
from parallel_r1.mirror import ensure, mirror_path
from parallel_r1.rewards import REWARDS
from stages.common import PARAMS_FILE, load_params

DEFAULT_TARGET = "rl@{configuration}"
TABLE_KEY = "sweep-comparison"
LINK_KEY = "sweep-mlflow"


@dataclass(frozen=True)
class Experiment:
    """One combination of the sweep: its DVC experiment name, target and `-S` overrides."""

    name: str
    target: str
    overrides: tuple[str, ...]
    labels: dict[str, str] = field(default_factory=dict, hash=False)

    def override_dict(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.overrides)


def plan_sweep(configurations: list[str], reward_schedules: list[str], seeds: list[int], profile: str,
               target: str | None, grid: dict[str, list[str]], sweep_id: str) -> list[Experiment]:
    """Every combination as an `Experiment`, in a stable order (configurations outermost)."""
    if not configurations and target is None:
        raise PipelineError("sweep: give configurations (rl_runs names) or a target stage")
    if reward_schedules and not configurations:
        raise PipelineError("sweep: reward_schedules need configurations "
                            "(they set rl_runs.<configuration>.reward)")
    grid_axes = [[(key, str(value)) for value in values] for key, values in grid.items()]
    experiments = []
    unset: list[None] = [None]
    combos = itertools.product(configurations or unset, reward_schedules or unset, seeds or unset,
                               itertools.product(*grid_axes))
    for index, (configuration, schedule, seed, grid_items) in enumerate(combos, start=1):
        overrides = [f"profile={profile}"]
        labels = {"profile": profile}
        if configuration is not None:
            labels["configuration"] = configuration
        if schedule is not None:
            overrides.append(f"rl_runs.{configuration}.reward={schedule}")
            labels[tracking.TAG_REWARD_SCHEDULE] = schedule
        if seed is not None:
            overrides.append(f"seed={seed}")
            labels["seed"] = str(seed)
        overrides += [f"{key}={value}" for key, value in grid_items]
        slug = "-".join(_slug(part) for part in (configuration, schedule, seed and f"s{seed}") if part)
        name = f"{sweep_id}-{index}" + (f"-{slug}" if slug else "")
        chosen = (target or DEFAULT_TARGET).format(configuration=configuration or "")
        experiments.append(Experiment(name=name, target=chosen, overrides=tuple(overrides), labels=labels))
    return experiments


def check_names(params: dict, configurations: list[str], reward_schedules: list[str]) -> None:
    """One-line errors for configurations not in params.yaml rl_runs or unknown reward schedules."""
    known = params.get("rl_runs") or {}
    for name in configurations:
        if name not in known:
            raise PipelineError(f"params.yaml rl_runs: no configuration {name!r} (known: {', '.join(known)})")
    for name in reward_schedules:
        if name not in REWARDS:
            raise PipelineError(f"sweep reward_schedules: unknown schedule {name!r} "
                                f"(known: {', '.join(REWARDS)})")


def _mirror_copy(root: Path) -> list[str]:
    """The data mirror for a --temp experiment, which runs in a fresh clone of the commit, without the
    git-ignored mirror/ its stages depend on: verified here as `make data` does (filled first if needed),
    then copied into that clone by DVC (`--copy-paths`). Nothing for a mirror outside the project."""
    target = mirror_path(root)
    if target is None or not target.resolve().is_relative_to(root.resolve()):
        return []
    ensure(target, root, log=get_run_logger().info)
    return ["--copy-paths", str(target.resolve().relative_to(root.resolve()))]


@task(name="dvc-experiment", task_run_name="{experiment.name}", retries=2, retry_delay_seconds=10,
      retry_condition_fn=retry_only_transient, cache_policy=NO_CACHE)
def run_experiment(experiment: Experiment, run_id: str | None, root: str) -> None:
    """`dvc exp run --temp` for one combination, its stage runs nested under `run_id`."""
    args = ["exp", "run", "--temp", "--name", experiment.name, *_mirror_copy(Path(root))]
    for override in experiment.overrides:
        args += ["--set-param", override]
    try:
        run_dvc([*args, experiment.target], cwd=root, env=tracking.child_env(run_id),
                echo=get_run_logger().info)
    except DvcCommandError as err:
        raise type(err)(f"experiment {experiment.name}: {err}") from None


@flow(name="sweep")
def sweep(configurations: list[str], reward_schedules: list[str] = [], seeds: list[int] = [],  # noqa: B006
          profile: str | None = None, target: str | None = None,
          grid: dict[str, list[str]] = {}, pool: str | None = None,  # noqa: B006
          git_remote: str = "origin") -> list[dict]:
    """Run every combination as a DVC experiment and compare them.

    configurations: names under params.yaml `rl_runs` (each sets the default target rl@<name>).
    reward_schedules: reward names of parallel_r1.rewards, set as rl_runs.<configuration>.reward.
    seeds: values for the top-level `seed`.
    profile: small | tiny | paper, set as `profile` (default: params.yaml's, the profile the workspace runs).
    target: DVC stage or output to run instead of rl@<configuration> ("{configuration}" allowed).
    grid: further axes, dotted param path -> values (e.g. {"rl.lr": ["1e-6", "3e-6"]}).
    pool: a Prefect work pool: each experiment becomes a flow run of `experiment/<pool>` that any
        worker of the pool runs (flows/experiment.py); none: one after another in this process.
    git_remote: with a pool, the git remote the workers share (the sweep's commit and the
        experiments travel through it).
    Returns the comparison rows; the flow fails at the end if any experiment failed.
    """
    root = Path.cwd()
    params = load_params(root / PARAMS_FILE)
    profile = profile or str(params["profile"])
    check_names(params, configurations, reward_schedules)
    sweep_id = unique_id("sweep")
    experiments = plan_sweep(configurations, reward_schedules, seeds, profile, target, grid, sweep_id)
    logger = get_run_logger()
    logger.info("%s: %d experiments%s", sweep_id, len(experiments),
                f" on pool {pool!r} (`python -m flows.workpool timeline {sweep_id}`: which worker ran which)"
                if pool else "")
    if pool:
        workpool.check_shared_services("sweep on a pool")
        baseline_ref = push_baseline(root, git_remote, sweep_id)  # before the MLflow run: refusal makes none
    sweep_tags = {"flow": "sweep", "sweep_id": sweep_id, "prefect_flow_run_id": flow_run.get_id()}
    sweep_params = {"tracking": params.get("tracking") or {}, "configurations": configurations,
                    "reward_schedules": reward_schedules, "seeds": seeds, "profile": profile,
                    "target": target or DEFAULT_TARGET, "grid": grid, "pool": pool or ""}
    mlflow_experiment = tracking.experiment_name(params)
    with tracking.parent_run(sweep_id, params=sweep_params, tags=sweep_tags,
                             experiment=mlflow_experiment) as sweep_run:
        if pool:
            rows = _run_on_pool(experiments, pool, git_remote, baseline_ref, sweep_id, sweep_run)
        else:
            rows = _run_here(experiments, root, sweep_id, sweep_run, mlflow_experiment)
        _publish(rows, sweep_id, sweep_run)
        failures = [row["experiment"] for row in rows if row["state"] != "success"]
        if failures:  # inside the run, so the sweep's MLflow run ends FAILED too
            raise PipelineError(f"{sweep_id}: {len(failures)} of {len(rows)} experiments failed: "
                                f"{', '.join(failures)}")
    return rows


def _run_here(experiments: list[Experiment], root: Path, sweep_id: str, sweep_run: str | None,
              mlflow_experiment: str) -> list[dict]:
    """One machine: each experiment a `dvc exp run --temp` task of this flow, one after another."""
    rows, run_ids = [], {}
    for experiment in experiments:
        tags = {**experiment.labels, tracking.TAG_DVC_EXP: experiment.name, "sweep_id": sweep_id}
        state = "success"
        try:
            with tracking.parent_run(experiment.name, params=experiment.override_dict(), tags=tags,
                                     parent_run_id=sweep_run, experiment=mlflow_experiment) as run_id:
                run_ids[experiment.name] = run_id
                run_experiment(experiment, run_id, str(root))
        except DvcCommandError as err:
            state = str(err)
        rows.append(_row(experiment, state, run_ids.get(experiment.name) or ""))
    metrics = _experiment_metrics(root, [row["experiment"] for row in rows])
    for row in rows:
        row.update(metrics.get(row["experiment"], {}))
        tracking.log_metrics(metrics.get(row["experiment"], {}), run_id=run_ids.get(row["experiment"]))
    return rows


def _run_on_pool(experiments: list[Experiment], pool: str, git_remote: str, baseline_ref: str, sweep_id: str,
                 sweep_run: str | None, crash_retries: int = CRASH_RETRIES) -> list[dict]:
    """Many machines: every experiment a flow run on the pool at once; waits for all, reads their rows.

    A run that Crashed (its worker died: flows/workpool.py) is launched again, up to `crash_retries`
    times; a run that Failed (the stage's own error) is not. Other runs are never touched.
    """
    logger = get_run_logger()
    params = {experiment.name: {"name": experiment.name, "target": experiment.target,
                                "overrides": list(experiment.overrides), "baseline_ref": baseline_ref,
                                "sweep_id": sweep_id, "sweep_run_id": sweep_run, "labels": experiment.labels,
                                "git_remote": git_remote} for experiment in experiments}
    tag = workpool.SWEEP_TAG.format(sweep_id=sweep_id)
    finished, attempts = workpool.run_all(pool, "experiment", params, tag, crash_retries, echo=logger.info)
    found = workpool.results([run.id for run in finished.values()])
    rows = []
    for experiment in experiments:
        run = finished[experiment.name]
        result = dict(found.get(run.id) or {})
        ok = run.state.is_completed() and bool(result)
        state = "success" if ok else f"{run.state.type.value}: {run.state.message or 'no result'}"
        row = _row(experiment, state, result.pop("mlflow_run_id", ""))
        row.update({"worker": result.pop("worker", ""), "attempts": attempts[experiment.name],
                    "start": run.start_time.isoformat(timespec="seconds") if run.start_time else "",
                    "end": run.end_time.isoformat(timespec="seconds") if run.end_time else ""})
        result.pop("experiment", None)
        row.update(result)
        rows.append(row)
    return rows


def _row(experiment: Experiment, state: str, mlflow_run_id: str) -> dict:
    return {"experiment": experiment.name, **experiment.labels, "target": experiment.target,
            "overrides": " ".join(experiment.overrides), "state": state, "mlflow_run_id": mlflow_run_id}


def _experiment_metrics(root: Path, names: list[str]) -> dict[str, dict[str, float]]:
    return experiment_metrics(cast("list[dict]", dvc_json(["exp", "show", "--json"], cwd=root)), names)


def _publish(rows: list[dict], sweep_id: str, sweep_run: str | None) -> None:
    """The comparison table and the MLflow link as Prefect artifacts."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    table = [{column: row.get(column, "") for column in columns} for row in rows]
    create_table_artifact(table, key=TABLE_KEY, description=f"{sweep_id}: one row per DVC experiment")
    url = tracking.run_url(sweep_run) if sweep_run else None
    if url:
        link = f"[{sweep_id} in MLflow]({url}) — child runs: one per experiment."
    elif sweep_run:
        link = (f"MLflow run `{sweep_run}` ({sweep_id}) in `{tracking.tracking_uri()}`; "
                "browse it with `make ui` or `mlflow ui --backend-store-uri <that uri>`.")
    else:
        link = "MLflow tracking was off for this sweep."
    create_markdown_artifact(f"## {sweep_id}\n\n{link}\n\nCompare: `dvc exp show`.", key=LINK_KEY,
                             description=f"{sweep_id}: where the runs are")


def _slug(value: object) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "_", str(value)).strip("_")


def main() -> None:
    parser = argparse.ArgumentParser(description="a sweep of DVC experiments as a Prefect flow")
    parser.add_argument("configurations", nargs="*", help="names under params.yaml rl_runs")
    parser.add_argument("--reward-schedules", nargs="*", default=[])
    parser.add_argument("--seeds", nargs="*", type=int, default=[])
    parser.add_argument("--profile", help="small | tiny | paper (default: params.yaml's)")
    parser.add_argument("--target", help="stage or output to run instead of rl@<configuration>")
    parser.add_argument("--grid", nargs="*", default=[], metavar="PATH=V1,V2", help="further param axes")
    parser.add_argument("--pool", help="Prefect work pool: each experiment on a worker of it (make worker)")
    parser.add_argument("--git-remote", default="origin", help="with --pool: the git remote workers share")
    args = parser.parse_args()
    grid = {}
    for item in args.grid:
        if "=" not in item:
            raise SystemExit(f"error: --grid {item!r}: expected PATH=V1,V2")
        key, values = item.split("=", 1)
        grid[key] = values.split(",")
    sweep(configurations=args.configurations, reward_schedules=args.reward_schedules, seeds=args.seeds,
          profile=args.profile, target=args.target, grid=grid, pool=args.pool, git_remote=args.git_remote)


if __name__ == "__main__":
    main()
