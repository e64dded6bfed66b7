"""Prefect flow `reproduce`: `dvc repro <targets>`, one Prefect task per DVC stage.

    python -m flows.reproduce reports/table1.md            # ephemeral Prefect, local MLflow
    python -m flows.reproduce --profile paper --force      # params.yaml <- the paper profile, every stage

The stage list and order are DVC's own (`plan_stages`), so the Prefect UI shows each stage's
state, log and duration. Each task runs `dvc repro --single-item <stage>` — one at a time, since
two `dvc repro` in one workspace fight over the repo lock; a stage that is up to date finishes in
seconds. A task retries only when DVC could not take its lock (another DVC process), never on the
stage's own failure: the flow then fails with the stage's one-line error. Stage runs in MLflow
nest under this flow's run (env PARALLEL_R1_PARENT_RUN_ID); the flow ends by writing
reports/run_summary.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from flows.dvc_runner import DvcCommandError, TransientDvcError, plan_stages, run_dvc
from flows.project_lock import holds_project_lock
from parallel_r1 import tracking
from parallel_r1.run_summary import write_run_summary
from stages.common import load_params
from stages.profiles import switch as switch_profile

PARAMS_FILE = "params.yaml"


def retry_only_transient(task, task_run, state) -> bool:
    """Prefect retry condition: retry lock contention, not a stage that failed by itself."""
    return isinstance(state.data, TransientDvcError)


@task(name="dvc-stage", task_run_name="{stage}", retries=2, retry_delay_seconds=10,
      retry_condition_fn=retry_only_transient, cache_policy=NO_CACHE)
def repro_stage(stage: str, force: bool, parent_run_id: str | None, root: str) -> str:
    """`dvc repro --single-item <stage>`; returns "ran" or "up to date"."""
    logger = get_run_logger()
    args = ["repro", "--single-item", *(["--force"] if force else []), stage]
    try:
        lines = run_dvc(args, cwd=root, env=tracking.child_env(parent_run_id), echo=logger.info)
    except DvcCommandError as err:
        raise type(err)(f"stage {stage}: {err}") from None
    return "up to date" if any("didn't change, skipping" in line for line in lines) else "ran"


@flow(name="reproduce")
@holds_project_lock   # the whole invocation: DVC's own lock is released while a stage command runs
def reproduce(targets: list[str] = [], profile: str | None = None, force: bool = False) -> dict[str, str]:  # noqa: B006
    """Reproduce DVC `targets` (stages or outputs; none = everything) stage by stage.

    profile: small | tiny | paper — composed into params.yaml first when given (`stages.profiles`; refused
        when params.yaml holds hand edits), so the outputs match it.
    force: rerun every planned stage even when up to date.
    Returns {stage: "ran" | "up to date"} in the order the stages ran.
    """
    root = Path.cwd()
    if profile:
        switch_profile(root, profile)
    params = load_params(root / PARAMS_FILE)
    stages = plan_stages(targets, root)
    get_run_logger().info("plan (%s): %s", params["profile"], ", ".join(stages))
    name = f"reproduce@{','.join(targets) or 'all'}"
    run_tags = {"flow": "reproduce", "prefect_flow_run_id": flow_run.get_id(), tracking.TAG_PROFILE: params["profile"]}
    outcome: dict[str, str] = {}
    started = time.monotonic()
    with tracking.parent_run(name, params={"tracking": params.get("tracking") or {}, "targets": targets,
                                           "force": force}, tags=run_tags) as run_id:
        for stage in stages:
            outcome[stage] = repro_stage(stage, force, run_id, str(root))
        summary = write_run_summary(root, name, load_params(root / PARAMS_FILE), time.monotonic() - started,
                                    run_id)
    get_run_logger().info("run summary: %s", summary)
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description="dvc repro as a Prefect flow, one task per stage")
    parser.add_argument("targets", nargs="*", help="DVC stages or outputs (default: all)")
    parser.add_argument("--profile", help="small | tiny | paper (composed into params.yaml first)")
    parser.add_argument("--force", action="store_true", help="rerun stages that are up to date")
    args = parser.parse_args()
    reproduce(targets=args.targets, profile=args.profile, force=args.force)


if __name__ == "__main__":
    main()
