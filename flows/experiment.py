"""Prefect flow `experiment`: one experiment of a sweep, run by a work-pool worker on any machine.

The `sweep` flow launches one run of this flow per combination on a work pool (flows/workpool.py);
a worker started in a clone of the project (`make worker`) picks it up, and the deployment's pull
step makes that clone (env PARALLEL_R1_CLONE) the working directory. The run then:

1. clones the sweep's commit (`refs/sweeps/<sweep id>` on the git remote) into a private folder under
   the worker clone's .dvc/tmp, on the worker's DVC cache and remote (flows/remote.py);
2. `dvc exp run --pull --name <name> -S ... <target>`: DVC fetches from the remote only what the
   target's stages are missing (and restores any stage the run cache knows), runs the rest;
3. `dvc exp push --run-cache <git remote> <name>`: the experiment's git ref to the git remote, its
   outputs and the run cache to the DVC remote, so any clone can `dvc exp pull` / `dvc exp apply`;
4. publishes its row (worker, output hashes, metrics, MLflow run) as the table artifact
   `experiment-result`, which the sweep reads back.

Its MLflow run is created here, a child of the sweep's run (`sweep_run_id`), on the tracking URI of
the worker's environment (MLFLOW_TRACKING_URI: the one server every worker reaches); the stage
runs of DVC nest under it as on one machine. The private clone is removed at the end, success or not.
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
from flows.dvc_runner import DvcCommandError, plan_stages, run_dvc, workspace_metrics
from parallel_r1 import tracking
from stages.common import load_params

RESULT_KEY = "experiment-result"
WORKER_ENV = "PREFECT__WORKER_NAME"  # set by Prefect workers in each flow run's environment


def private_folder(worker_clone: Path, name: str, run_id: str) -> Path:
    """Where one run clones the sweep's commit: inside .dvc/tmp, which DVC and git ignore."""
    return worker_clone / ".dvc" / "tmp" / "pool" / f"{name}-{run_id[:8]}"


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
    try:
        remote.private_clone(worker_clone, git_remote, baseline_ref, work)
        mlflow_experiment = tracking.experiment_name(load_params(work / "params.yaml"))
        tags = {**labels, tracking.TAG_DVC_EXP: name, "sweep_id": sweep_id, "worker": worker,
                "prefect_flow_run_id": flow_run.get_id()}
        params = dict(item.split("=", 1) for item in overrides)
        with tracking.parent_run(name, params=params, tags=tags, parent_run_id=sweep_run_id,
                                 experiment=mlflow_experiment) as run_id:
            args = ["exp", "run", "--pull", "--name", name]
            for override in overrides:
                args += ["--set-param", override]
            _dvc([*args, target], work, tracking.child_env(run_id), logger.info, name)
            _dvc(["exp", "push", "--run-cache", git_remote, name], work, None, logger.info, name)
            metrics = workspace_metrics(work)
            tracking.log_metrics(metrics, run_id=run_id)
        row = {"experiment": name, "worker": worker, "mlflow_run_id": run_id or "",
               "outs": json.dumps(remote.stage_outs(work, plan_stages([target], work)), sort_keys=True),
               **metrics}
        create_table_artifact([row], key=RESULT_KEY, description=f"{name}: its worker, outputs and metrics")
        return row
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _dvc(args: list[str], cwd: Path, env, echo, name: str) -> list[str]:
    try:
        return run_dvc(args, cwd=cwd, env=env, echo=echo)
    except DvcCommandError as err:
        raise type(err)(f"experiment {name}: {err}") from None
