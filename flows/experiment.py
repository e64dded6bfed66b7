"""Prefect flow `experiment`: one experiment of a sweep, run by a work-pool worker on any machine.

The `sweep` flow launches one run of this flow per combination on a work pool (flows/workpool.py);
a worker started in a clone of the project (`make worker`) picks it up, and the deployment's pull
step makes that clone (env PARALLEL_R1_CLONE) the working directory. The run then:

1. clones the sweep's commit (`refs/sweeps/<sweep id>` on the git remote) into a private folder under
   the worker clone's .dvc/tmp, on the worker's DVC cache and remote, its data mirror the worker clone's
   (flows/remote.py);
2. pulls the experiment's training checkpoints from the DVC remote, if an earlier attempt on a worker
   that died pushed any (flows/checkpoint_sync.py): the training stage resumes from them;
3. `dvc exp run --pull --name <name> -S ... <target>`: DVC fetches from the remote only what the
   target's stages are missing (and restores any stage the run cache knows), runs the rest; meanwhile
   a thread pushes each new complete checkpoint to the DVC remote;
4. all or nothing (`remote.push_experiment`): `dvc push --run-cache`, its outputs and the run cache to
   the DVC remote, then `dvc exp push --no-cache <git remote> <name>`, its git ref (none without its data),
   so any clone can `dvc exp pull` / `dvc exp apply`; then its checkpoints are deleted from the remote;
5. publishes its row (worker, output hashes, metrics, MLflow run, `resumed_from`) as the table artifact
   `experiment-result`, which the sweep reads back.

Its MLflow run is created here, a child of the sweep's run (`sweep_run_id`), on the tracking URI of
the worker's environment (MLFLOW_TRACKING_URI: the one server every worker reaches); the stage
runs of DVC nest under it as on one machine. The private clone is removed at the end, success or not;
the folders of runs killed with their worker (whose `finally` never ran) are removed by the next run on
the same clone once the Prefect API says their run has ended (`stale_folders`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.runtime import flow_run

from flows import remote
from flows.checkpoint_sync import CheckpointStore, PushingInBackground
from flows.dvc_runner import DvcCommandError, plan_stages, run_dvc, workspace_metrics
from parallel_r1 import tracking
from stages.common import load_params

RESULT_KEY = "experiment-result"
WORKER_ENV = "PREFECT__WORKER_NAME"  # set by Prefect workers in each flow run's environment


def private_folder(worker_clone: Path, name: str, run_id: str) -> Path:
    """Where one run clones the sweep's commit: inside .dvc/tmp, which DVC and git ignore."""
    return worker_clone / ".dvc" / "tmp" / "pool" / f"{name}-{run_id[:8]}"


def stale_folders(current: Path) -> list[Path]:
    """The private folders beside `current` (the clone's .dvc/tmp/pool/) whose flow run has ended (any
    final state, a Crashed one included), as the Prefect API has them; never `current`, nor one whose run
    is unknown (another server's, a name the API does not find) or still pending or running."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    pool = current.parent
    folders = {path: path.name.rsplit("-", 1) for path in pool.iterdir()
               if path.is_dir() and path != current and "-" in path.name} if pool.is_dir() else {}
    if not folders:
        return []
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=sorted({name for name, _ in folders.values()}))))
    ended = {(run.name, str(run.id)[:8]) for run in runs if run.state is not None and run.state.is_final()}
    return [path for path, (name, short_id) in folders.items() if (name, short_id) in ended]


@flow(name="experiment", flow_run_name="{name}")
def experiment(name: str, target: str, overrides: list[str], baseline_ref: str, sweep_id: str,
               sweep_run_id: str | None = None, labels: dict[str, str] = {},  # noqa: B006
               git_remote: str = "origin") -> dict:
    """Run one DVC experiment from the sweep's commit and push it to the git and DVC remotes.

    name: the DVC experiment name; target: its stage or output; overrides: `-S` values.
    baseline_ref: the git ref the sweep pushed its commit to; sweep_run_id: the sweep's MLflow run.
    Returns (and publishes as artifact `experiment-result`) the experiment's row.
    """
    logger = get_run_logger()
    worker_clone = Path.cwd()
    worker = os.environ.get(WORKER_ENV) or socket.gethostname()
    work = private_folder(worker_clone, name, flow_run.get_id() or "local")
    logger.info("%s on worker %s: clone of %s in %s", name, worker, baseline_ref, work)
    remove_stale_folders(work, logger)
    try:
        remote.private_clone(worker_clone, git_remote, baseline_ref, work, log=logger.info)
        checkpoints = CheckpointStore.for_experiment(work, sweep_id, name)
        resumed_from = pull_checkpoints(checkpoints, work, name, logger)
        mlflow_experiment = tracking.experiment_name(load_params(work / "params.yaml"))
        tags = {**labels, tracking.TAG_DVC_EXP: name, "sweep_id": sweep_id, "worker": worker,
                "prefect_flow_run_id": flow_run.get_id()}
        params = dict(item.split("=", 1) for item in overrides)
        with tracking.parent_run(name, params=params, tags=tags, parent_run_id=sweep_run_id,
                                 experiment=mlflow_experiment) as run_id:
            args = ["exp", "run", "--pull", "--name", name]
            for override in overrides:
                args += ["--set-param", override]
            with PushingInBackground(checkpoints, work, logger.info):
                _dvc([*args, target], work, tracking.child_env(run_id), logger.info, name)
            try:
                remote.push_experiment(work, git_remote, name, logger.info)
            except DvcCommandError as err:
                raise type(err)(f"experiment {name}: {err}") from None
            remove_checkpoints(checkpoints, logger)
            metrics = workspace_metrics(work)
            tracking.log_metrics(metrics, run_id=run_id)
        row = {"experiment": name, "worker": worker, "mlflow_run_id": run_id or "",
               "resumed_from": resumed_from,
               "outs": json.dumps(remote.stage_outs(work, plan_stages([target], work)), sort_keys=True),
               **metrics}
        create_table_artifact([row], key=RESULT_KEY, description=f"{name}: its worker, outputs and metrics")
        return row
    finally:
        shutil.rmtree(work, ignore_errors=True)


def remove_stale_folders(work: Path, logger) -> None:
    try:
        stale = stale_folders(work)
    except Exception as err:  # noqa: BLE001 -- housekeeping: the experiment runs without it
        logger.warning("private folders beside %s not checked: %s", work, err)
        return
    for folder in stale:
        logger.info("removing %s: its flow run has ended (its worker was killed?)", folder)
        shutil.rmtree(folder, ignore_errors=True)


def pull_checkpoints(checkpoints: CheckpointStore, work: Path, name: str, logger) -> str:
    """An earlier attempt's checkpoints into the private clone; their names ("" if none). One that cannot
    be copied whole is dropped with a warning: the run then starts afresh, as without a remote copy."""
    try:
        restored = checkpoints.pull(work)
    except (OSError, ValueError) as err:
        logger.warning("%s: the checkpoints on %s could not be pulled (%s); starting afresh",
                       name, checkpoints.url(), err)
        shutil.rmtree(work / "checkpoints", ignore_errors=True)
        return ""
    for checkpoint in restored:
        logger.info("resuming %s from %s pulled from the remote", name, checkpoint)
    return " ".join(restored)


def remove_checkpoints(checkpoints: CheckpointStore, logger) -> None:
    """The experiment is on the remotes: no retry will need its checkpoints. Left behind, they only take
    space, so a failure to delete them is a warning."""
    try:
        checkpoints.remove()
    except OSError as err:
        logger.warning("checkpoints on %s not deleted (%s); delete them by hand", checkpoints.url(), err)


def _dvc(args: list[str], cwd: Path, env, echo, name: str) -> list[str]:
    try:
        return run_dvc(args, cwd=cwd, env=env, echo=echo)
    except DvcCommandError as err:
        raise type(err)(f"experiment {name}: {err}") from None
