"""Prefect flow `reproduce`: `dvc repro <targets>`, one Prefect task per DVC stage. `make run` is this flow.

    make run                                               # python -m flows.reproduce: every stage
    python -m flows.reproduce reports/table1.md            # a target and what it needs
    python -m flows.reproduce --single-item table2 --force # that stage only, even when up to date
    python -m flows.reproduce --profile paper --force      # params.yaml <- the paper profile, every stage

With no Prefect server configured (PREFECT_API_URL unset) Prefect starts a temporary one on this machine over
the project's own database (PREFECT_HOME=.prefect, as `make` sets it), so `make ui` shows the run afterwards.
On one machine one `dvc repro` runs the whole plan (DVC's own order and checks, one DVC start-up); its output
is cut at each stage's first line ("Running stage 'x'", "Stage 'x' didn't change", "... is cached") into one
Prefect task run per stage, whose log holds that stage's lines: the UI shows each stage's state, log and
duration. A stage that fails fails its task and the flow with the stage's one-line error. Stage runs in
MLflow nest under this flow's run (env PARALLEL_R1_PARENT_RUN_ID); the flow ends by writing
reports/run_summary.md. One pipeline run at a time per project (parallel_r1.project_lock).

    python -m flows.reproduce --pool parallel-r1           # independent stages on the pool's workers

With `pool`, stages run in rounds: a stage is ready when its upstream stages are done (`plan_graph`).
When two or more ready stages need running (none depends on another: the evaluations of different
checkpoints, RL runs whose inputs exist), the workspace pushes its outputs and DVC's run cache to the
DVC remote and its commit to the git remote, and each of them runs on a worker of the pool
(flows/pool_stage.py), which pushes its outputs and run-cache entry back. The workspace then runs them
as without a pool, with `dvc repro --pull`: DVC pulls the run cache, finds the workers' entries and
checks their outputs out instead of recomputing them, so dvc.lock is the one a one-machine run writes.
The workers run the last commit plus the workspace's params.yaml (a profile switched for this run needs no
commit; `flows.remote.push_baseline`), so other tracked files but dvc.lock must be committed.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.utilities.annotations import quote

from flows import workpool
from flows.dvc_runner import (
    DvcCommandError,
    DvcStream,
    TransientDvcError,
    dvc_json,
    plan_graph,
    plan_stages,
    run_dvc,
    target_stages,
)
from flows.remote import push_baseline, unique_id
from parallel_r1 import tracking
from parallel_r1.project_lock import holds_project_lock, project_lock
from parallel_r1.run_summary import write_run_summary
from stages import profiles
from stages.common import PARAMS_FILE, load_params, stage_main
from stages.profiles import switch as switch_profile

CRASH_RETRIES = 2  # on a pool: launches of a stage whose worker died, after the first
# DVC's first line of a stage in `dvc repro`'s output, and what it says about the stage.
STAGE_LINES = ((re.compile(r"^Running stage '(?P<stage>[^']+)':"), "ran"),
               (re.compile(r"^Stage '(?P<stage>[^']+)' didn't change, skipping"), "up to date"),
               (re.compile(r"^Stage '(?P<stage>[^']+)' is cached - skipping run"), "restored"))
FAILED_STAGE = re.compile(r"failed to reproduce '(?P<stage>[^']+)'")


def stage_line(line: str) -> tuple[str, str] | None:
    """(stage, "ran" | "up to date" | "restored") when `line` is DVC's first line of a stage, else None."""
    for pattern, outcome in STAGE_LINES:
        if match := pattern.match(line):
            return match["stage"], outcome
    return None


def retry_only_transient(task, task_run, state) -> bool:
    """Prefect retry condition: retry lock contention, not a stage that failed by itself."""
    return isinstance(state.data, TransientDvcError)


@task(name="dvc-stage", task_run_name="{stage}", retries=2, retry_delay_seconds=10,
      retry_condition_fn=retry_only_transient, cache_policy=NO_CACHE)
def repro_stage(stage: str, force: bool, parent_run_id: str | None, root: str, pull: bool = False) -> str:
    """`dvc repro --single-item <stage>` (`--pull`: first from the DVC remote and its run cache);
    returns "ran", "up to date" or "restored" (from the run cache)."""
    logger = get_run_logger()
    args = ["repro", "--single-item", *(["--force"] if force else []), *(["--pull"] if pull else []), stage]
    try:
        lines = run_dvc(args, cwd=root, env=tracking.child_env(parent_run_id), echo=logger.info)
    except DvcCommandError as err:
        raise type(err)(f"stage {stage}: {err}") from None
    if any("didn't change, skipping" in line for line in lines):
        return "up to date"
    return "restored" if any("is cached - skipping run" in line for line in lines) else "ran"


@task(name="dvc-stage", task_run_name="{stage}", cache_policy=NO_CACHE)
def follow_stage(stage: str, outcome: str, first_line: str, stream: DvcStream) -> str:
    """One stage of a streaming `dvc repro`: its lines (from `first_line` to the next stage's first line)
    into this task's log. Fails with DVC's one-line error when DVC failed during this stage."""
    logger = get_run_logger()
    logger.info(first_line)
    for line in stream:
        if stage_line(line):
            stream.push_back(line)
            return outcome
        logger.info(line)
    failure = stream.error()
    named = FAILED_STAGE.search(str(failure)) if failure else None
    if failure is None or (named and named["stage"] != stage):  # DVC failed before the next stage began
        return outcome
    raise type(failure)(f"stage {stage}: {failure}")


def repro_streamed(args: list[str], root: Path, parent_run_id: str | None) -> dict[str, str]:
    """`dvc <args>` (a `repro`) in one process, each stage of its output a `follow_stage` task run;
    returns {stage: outcome} in DVC's order. DVC's own failure outside any stage raises here."""
    logger, outcome = get_run_logger(), {}
    with DvcStream(args, root, tracking.child_env(parent_run_id)) as stream:
        for line in stream:
            if (found := stage_line(line)) is None:
                logger.info(line)
                continue
            stage, result = found
            outcome[stage] = follow_stage(stage, result, line, quote(stream))
    return outcome


@flow(name="reproduce")
@holds_project_lock   # the whole invocation: DVC's own lock is released while a stage command runs
def reproduce(targets: list[str] = [], profile: str | None = None, force: bool = False,  # noqa: B006
              pool: str | None = None, git_remote: str = "origin",
              single_item: bool = False) -> dict[str, str]:
    """Reproduce DVC `targets` (stages or outputs; none = everything) stage by stage.

    profile: small | tiny | paper — composed into params.yaml first when given (`stages.profiles`; refused
        when params.yaml holds hand edits), so the outputs match it.
    force: rerun every planned stage even when up to date.
    pool: a Prefect work pool: ready stages that can run at once go to its workers (make worker).
    git_remote: with a pool, the git remote the workers clone the workspace's commit from.
    single_item: the targets' own stages only, not what they depend on (`dvc repro --single-item`).
    Returns {stage: "ran" | "up to date" | "restored"} in the order the stages ran.
    """
    root = Path.cwd()
    if pool:
        workpool.check_shared_services("reproduce on a pool")
    if profile:
        switch_profile(root, profile)
    params = load_params(root / PARAMS_FILE)
    from stages.rl import check_run_names  # here: it imports the training code

    check_run_names(params)   # before DVC, which would delete a run's outputs and then fail on a typo
    if edited := profiles.edits(root):  # kept, as DVC would; said, so no result is silently from hand edits
        get_run_logger().warning("params.yaml differs from conf/profile/%s.yaml at %s%s; running with "
                                 "params.yaml as it is", params["profile"], ", ".join(edited[:3]),
                                 " ..." if len(edited) > 3 else "")
    stages = target_stages(targets, root) if single_item else plan_stages(targets, root)
    get_run_logger().info("plan (%s): %s", params["profile"], ", ".join(stages))
    name = f"reproduce@{','.join(targets) or 'all'}"
    run_tags = {"flow": "reproduce", "prefect_flow_run_id": flow_run.get_id(),
                tracking.TAG_PROFILE: params["profile"]}
    outcome: dict[str, str] = {}
    started = time.monotonic()
    with tracking.parent_run(name, params={"tracking": params.get("tracking") or {}, "targets": targets,
                                           "force": force, "pool": pool or ""}, tags=run_tags) as run_id:
        if pool is None:
            dvc_targets = target_stages(targets, root) if targets else []
            outcome.update(repro_streamed(["repro", *(["--force"] if force else []),
                                           *(["--single-item"] if single_item else []), *dvc_targets],
                                          root, run_id))
        else:
            _fan_out(pool, git_remote, stages, root, force, run_id, outcome)
        ran = [stage for stage, result in outcome.items() if result == "ran"]  # for those MLflow lacks
        summary = write_run_summary(root, name, load_params(root / PARAMS_FILE), time.monotonic() - started,
                                    run_id, ran)
    get_run_logger().info("run summary: %s", summary)
    return outcome


def _fan_out(pool: str, git_remote: str, stages: list[str], root: Path, force: bool, run_id: str | None,
             outcome: dict[str, str]) -> None:
    """Greedy rounds over the planned `stages`: the stages whose upstream stages are done are ready;
    up-to-date ones are confirmed here first (they may make more stages ready); then, when two or more
    ready stages must run, they go to the pool at once and are restored here from the run cache; a lone
    one runs here."""
    reproduce_id = unique_id("reproduce")
    get_run_logger().info("%s: ready stages that can run at once go to pool %r; `python -m flows.workpool "
                          "timeline %s` shows which worker ran which", reproduce_id, pool, reproduce_id)
    planned = plan_graph(stages, root)
    upstream = {stage: [up for up in ups if up in stages] for stage, ups in planned.items()
                if stage in stages}
    done: set[str] = set()
    ref = None
    while len(done) < len(upstream):
        ready = [stage for stage, ups in upstream.items() if stage not in done and set(ups) <= done]
        fresh = [] if force else [stage for stage in ready if not _stale(root, stage)]
        for stage in fresh:
            outcome[stage] = repro_stage(stage, False, run_id, str(root))
        done.update(fresh)
        if fresh:
            continue
        sent = ready if len(ready) > 1 else []
        if sent:
            ref = ref or push_baseline(root, git_remote, reproduce_id, allowed={"dvc.lock"},
                                       carried={str(PARAMS_FILE)})
            run_dvc(["push", "--run-cache"], cwd=root, echo=get_run_logger().info)  # their inputs
            _run_on_pool(pool, sent, ref, run_id, force, git_remote, reproduce_id)
        for stage in ready:  # a worker's stage is restored from the run cache here, not run again
            outcome[stage] = repro_stage(stage, force and not sent, run_id, str(root), pull=bool(sent))
        done.update(ready)


def _stale(root: Path, stage: str) -> bool:
    """Whether `dvc status` says the stage must run (changed deps, params, outputs or command)."""
    return bool(dvc_json(["status", "--json", stage], cwd=root))  # this stage only (no --with-deps)


def _run_on_pool(pool: str, stages: list[str], ref: str, parent_run_id: str | None, force: bool,
                 git_remote: str, reproduce_id: str, crash_retries: int = CRASH_RETRIES) -> None:
    """Each stage a `pool-stage` flow run on the pool; waits for all; one line naming those that failed.

    A run that Crashed (its worker died: flows/workpool.py) is launched again at once, up to `crash_retries`
    times, and resumes from the checkpoint it pushed; one that Failed (the stage's own error) is not."""
    logger = get_run_logger()
    params = {stage: {"stage": stage, "baseline_ref": ref, "parent_run_id": parent_run_id, "force": force,
                      "git_remote": git_remote, "reproduce_id": reproduce_id} for stage in stages}
    finished, _ = workpool.run_all(pool, "pool-stage", params, f"reproduce:{reproduce_id}", crash_retries,
                                   echo=logger.info)
    failed = [f"{run.name} ({run.state.type.value}: {run.state.message})" for run in finished.values()
              if not run.state.is_completed()]
    if failed:
        raise DvcCommandError(f"{reproduce_id}: stages failed on pool {pool!r}: {'; '.join(failed)}")


@stage_main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flows.reproduce",
                                     description="dvc repro as a Prefect flow, one task per stage")
    parser.add_argument("targets", nargs="*", help="DVC stages or outputs (default: all)")
    parser.add_argument("--profile", help="small | tiny | paper (composed into params.yaml first)")
    parser.add_argument("--force", action="store_true", help="rerun stages that are up to date")
    parser.add_argument("--single-item", action="store_true", help="the targets only, not their upstream")
    parser.add_argument("--pool", help="Prefect work pool: independent stages on its workers (make worker)")
    parser.add_argument("--git-remote", default="origin", help="with --pool: the git remote workers use")
    args = parser.parse_args(argv)
    root = Path.cwd()
    from stages.rl import check_run_names  # here: it imports the training code

    try:
        with project_lock(root):  # before Prefect starts: a refusal is one line, not a failed flow run
            check_run_names(profiles.compose(root, args.profile) if args.profile
                            else load_params(root / PARAMS_FILE))
            reproduce(targets=args.targets, profile=args.profile, force=args.force, pool=args.pool,
                      git_remote=args.git_remote, single_item=args.single_item)
    except KeyboardInterrupt:  # DVC and its stage are stopped; the MLflow run ends KILLED
        print("error: interrupted (Ctrl-C); dvc repro and its stage stopped", file=sys.stderr)
        sys.exit(130)
    finally:  # the temporary Prefect server's "Stopping ..." at exit would follow a failure's one line
        logging.getLogger("prefect").setLevel(logging.WARNING)


if __name__ == "__main__":
    main()
