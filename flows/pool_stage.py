"""Prefect flow `pool-stage`: one DVC stage of a fanned-out `reproduce`, run by a work-pool worker.

`reproduce --pool` (flows/reproduce.py) sends the stages of one wave that need running (independent of
each other: evaluations of different checkpoints, RL runs whose inputs are ready) here, one flow run
each. In a private clone of the workspace's commit (flows/remote.py), on the worker's DVC cache:

1. `dvc repro --pull <upstream stages>`: their outputs come from the DVC remote (the workspace pushed
   them and its run cache first): the lock file's entries, or DVC's run cache where the workspace's
   dvc.lock is not committed; nothing upstream is recomputed when the workspace already has it;
2. `dvc repro --pull --single-item [--force] <stage>`: the stage itself (or its run-cache entry);
3. `dvc push --run-cache <stage>`: its outputs and its run-cache entry to the DVC remote.

As a sweep's experiment does (flows/experiment.py), a training stage's newest complete checkpoint is copied
to the DVC remote while it trains (flows/checkpoint_sync.py, under checkpoints/<reproduce id>/<stage>/): a
run whose worker died is marked Crashed and launched again by `reproduce` (on another worker), which pulls
the checkpoint and resumes from it. Once the stage's outputs are pushed its checkpoints are deleted.

The workspace then runs the stage's own `dvc repro --pull --single-item`: DVC finds the entry in the run
cache and checks the outputs out instead of recomputing them, so `dvc.lock` reads as if the stage had
run there, and `dvc status` is truthful. Stage runs in MLflow nest under the reproduce run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.runtime import flow_run

from flows import remote
from flows.checkpoint_sync import CheckpointStore, PushingInBackground
from flows.dvc_runner import DvcCommandError, plan_stages, run_dvc
from flows.experiment import (
    WORKER_ENV,
    private_folder,
    pull_checkpoints,
    remove_checkpoints,
    remove_stale_folders,
)
from parallel_r1 import tracking

RESULT_KEY = "stage-result"


@flow(name="pool-stage", flow_run_name="{stage}")
def pool_stage(stage: str, baseline_ref: str, parent_run_id: str | None = None, force: bool = False,
               git_remote: str = "origin", reproduce_id: str = "local") -> dict:
    """Run DVC stage `stage` from the commit at `baseline_ref` and push its outputs and run cache.

    reproduce_id: the fanned-out run's id: where on the DVC remote this stage's checkpoints wait for a retry.
    Returns (and publishes as artifact `stage-result`) {stage, worker, outs: {path: hash}, resumed_from}.
    """
    logger = get_run_logger()
    worker_clone = Path.cwd()
    worker = os.environ.get(WORKER_ENV) or socket.gethostname()
    safe_name = re.sub(r"[^A-Za-z0-9_.-]+", "_", stage)
    work = private_folder(worker_clone, safe_name, flow_run.get_id() or "local")
    logger.info("%s on worker %s: clone of %s in %s", stage, worker, baseline_ref, work)
    remove_stale_folders(work, logger)
    env = tracking.child_env(parent_run_id)
    try:
        remote.private_clone(worker_clone, git_remote, baseline_ref, work, log=logger.info)
        checkpoints = CheckpointStore.for_experiment(work, reproduce_id, safe_name)
        resumed_from = pull_checkpoints(checkpoints, work, stage, logger)
        upstream = [name for name in plan_stages([stage], work) if name != stage]
        try:
            if upstream:
                run_dvc(["repro", "--pull", *upstream], cwd=work, env=env, echo=logger.info)
            with PushingInBackground(checkpoints, work, logger.info):
                run_dvc(["repro", "--pull", "--single-item", *(["--force"] if force else []), stage],
                        cwd=work, env=env, echo=logger.info)
            run_dvc(["push", "--run-cache", stage], cwd=work, echo=logger.info)
        except DvcCommandError as err:
            raise type(err)(f"stage {stage}: {err}") from None
        remove_checkpoints(checkpoints, logger)
        outs = json.dumps(remote.stage_outs(work, [stage]), sort_keys=True)
        row = {"stage": stage, "worker": worker, "outs": outs, "resumed_from": resumed_from}
        create_table_artifact([row], key=RESULT_KEY, description=f"{stage}: its worker and outputs")
        return row
    finally:
        shutil.rmtree(work, ignore_errors=True)
