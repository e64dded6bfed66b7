"""Scale-out across machines, on one (the lab: tests/scale_out_lab.py): a sweep on a Prefect work pool served
by two workers in two clones, through a bare git remote, the project's default filesystem DVC remote and one
MLflow server; another clone restoring its results; a fan-out `reproduce` of two evaluations; a sweep whose
worker is killed. tests/test_scale_out_stage_kill.py kills a worker under a fanned-out stage, in its own lab.

The sweep runs `prepare_model` (tiny profile: a seeded random-init model, seconds) with two seeds, so each
experiment produces a distinct model. The fan-out `reproduce` runs the project's real `evaluate` stage on two
checkpoints; the second is a copy of the base model with an RL run's rollout record, made by a test-only stage
`twin` (the tiny pipeline has no second checkpoint that costs seconds).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml

from tests.scale_out_lab import (
    EVALUATIONS,
    POOL,
    SWEEP_TIMEOUT_S,
    dvc,
    git,
    kill_machine,
    listed_experiments,
    make_data,
    md5,
    open_lab,
)

pytestmark = [pytest.mark.server, pytest.mark.slow]
_lab = pytest.fixture(scope="module", name="lab")(open_lab)


@pytest.fixture(scope="module")
def pool_sweep(lab):
    """`python -m flows.sweep --pool` from the launcher's CLI: 2 seeds of prepare_model (one per worker, each
    serving one run at a time); the sweep's rows."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.sweep import TABLE_KEY

    env = dict(lab["env"], PYTHONPATH=str(lab["launcher"]), PREFECT_HOME=str(lab["launcher"] / ".prefect"))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "flows.sweep", "--target", "prepare_model", "--grid",
                           "model.tiny.seed=1,2", "--pool", POOL], cwd=lab["launcher"], env=env,
                          capture_output=True, text=True, timeout=SWEEP_TIMEOUT_S)
    logs = {name: (lab["base"] / f"{name}.log").read_text(errors="replace")[-3000:]
            for name in ("worker-a", "worker-b")}
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n{logs}"
    with temporary_settings(updates={PREFECT_API_URL: lab["env"]["PREFECT_API_URL"]}), \
            get_client(sync_client=True) as client:
        (table,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[TABLE_KEY])))
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    print(f"\nsweep on 2 workers: {time.monotonic() - started:.0f} s from the CLI")
    return rows


def test_pool_sweep_runs_on_both_workers_and_every_experiment_nests_under_the_sweep_run(lab, pool_sweep):
    from mlflow import MlflowClient
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.workpool import timeline

    rows = pool_sweep
    assert len(rows) == 2 and all(row["state"] == "success" for row in rows), rows
    sweep_id = rows[0]["experiment"].rsplit("-", 1)[0]
    with temporary_settings(updates={PREFECT_API_URL: lab["env"]["PREFECT_API_URL"]}):
        runs = timeline(f"sweep:{sweep_id}")
    for run in runs:  # the closing note's timeline
        print(f"{run['name']:<24} {run['worker']:<20} {run['state']:<10} {run['start']} -> {run['end']}")
    assert sorted(run["name"] for run in runs) == sorted(row["experiment"] for row in rows)
    assert {run["state"] for run in runs} == {"COMPLETED"}
    assert {run["worker"][-len("worker-a"):] for run in runs} == {"worker-a", "worker-b"}  # <host>-<clone>
    client = MlflowClient(lab["env"]["MLFLOW_TRACKING_URI"])
    experiment_id = client.get_experiment_by_name("parallel-r1").experiment_id
    found = client.search_runs([experiment_id], filter_string=f"tags.sweep_id = '{sweep_id}'")
    (sweep_run,) = [run for run in found if "dvc_exp_name" not in run.data.tags]
    children = {run.data.tags["dvc_exp_name"]: run for run in found if "dvc_exp_name" in run.data.tags}
    assert sorted(children) == sorted(row["experiment"] for row in rows)
    assert {run.data.tags["mlflow.parentRunId"] for run in children.values()} == {sweep_run.info.run_id}
    assert {run.info.status for run in [sweep_run, *children.values()]} == {"FINISHED"}
    stage_runs = client.search_runs([experiment_id], filter_string="tags.stage = 'prepare_model'")
    parents = {run.data.tags["mlflow.parentRunId"] for run in stage_runs}
    assert parents >= {run.info.run_id for run in children.values()}


def test_another_clone_lists_every_experiment_and_restores_its_model_byte_for_byte(lab, pool_sweep):
    from flows.remote import localize_remote

    viewer, rows = lab["viewer"], pool_sweep
    names = sorted(row["experiment"] for row in rows)
    # what `make setup` writes: `dvc exp pull` reads each commit's .dvc/config, where the committed relative
    # remote resolved to /parallel-r1-dvc-remote and nothing came (exit 0)
    assert localize_remote(viewer) == str(lab["base"] / "parallel-r1-dvc-remote")
    dvc("exp", "pull", "origin", cwd=viewer)  # every experiment of HEAD, with its data
    assert set(names) <= listed_experiments(viewer)
    chosen = next(row for row in rows if row["experiment"] == names[-1])
    recorded = json.loads(chosen["outs"])["models/base"]
    assert (viewer / ".dvc" / "cache" / "files" / "md5" / recorded[:2] / recorded[2:]).is_file()
    # `exp apply` writes the experiment's files, then checks out every output of dvc.yaml: the ones with no
    # data here yet (this one until `dvc pull`, stages never run) make it exit 255 after applying
    applied = subprocess.run([sys.executable, "-m", "dvc", "exp", "apply", chosen["experiment"]], cwd=viewer,
                             capture_output=True, text=True)
    assert applied.returncode == 0 or "Is your cache up to date?" in applied.stderr, applied.stderr[-2000:]
    dvc("pull", "prepare_model", cwd=viewer)
    lock = yaml.safe_load((viewer / "dvc.lock").read_text())["stages"]["prepare_model"]
    (out,) = lock["outs"]
    assert out["md5"] == recorded
    remote = lab["base"] / "parallel-r1-dvc-remote" / "files" / "md5"
    manifest = json.loads((remote / recorded[:2] / recorded[2:]).read_text())
    assert manifest
    assert all(md5(viewer / "models" / "base" / entry["relpath"]) == entry["md5"] for entry in manifest)
    assert json.loads(dvc("status", "--json", "prepare_model", cwd=viewer)) == {}  # as dvc.lock records it
    other = next(row for row in rows if row["experiment"] == names[0])
    assert json.loads(other["outs"])["models/base"] != recorded  # another seed, another model


def test_fan_out_reproduce_of_two_evaluations_writes_the_dvc_lock_of_a_serial_run(lab):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.workpool import results

    base, launcher, env = lab["base"], lab["launcher"], lab["env"]
    serial = base / "serial"
    git("clone", "-q", str(base / "origin.git"), str(serial), cwd=base)
    make_data(serial, env)
    # a teammate's inputs, up to the validation the evaluations depend on: run, pushed (outputs, not the run
    # cache) and committed; then both evaluations here
    dvc("repro", "twin", "validate", cwd=serial)
    dvc("push", cwd=serial)
    git("add", "dvc.lock", cwd=serial)
    git("commit", "-qm", "inputs", cwd=serial)
    git("push", "-q", "origin", "HEAD:main", cwd=serial)
    started = time.monotonic()
    dvc("repro", *EVALUATIONS, cwd=serial)
    serial_s = time.monotonic() - started
    git("pull", "-q", "--ff-only", "origin", "main", cwd=launcher)
    dvc("pull", "--with-deps", "twin", "validate", cwd=launcher)
    launcher_env = dict(env, PYTHONPATH=str(launcher), PREFECT_HOME=str(launcher / ".prefect"))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "flows.reproduce", *EVALUATIONS, "--pool", POOL],
                          cwd=launcher, env=launcher_env, capture_output=True, text=True,
                          timeout=SWEEP_TIMEOUT_S)
    fan_out_s = time.monotonic() - started
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    print(f"\ntwo evaluations: serial dvc repro {serial_s:.0f} s, fan-out on 2 workers {fan_out_s:.0f} s")
    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}), \
            get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=EVALUATIONS)))
        rows = results([run.id for run in runs], "stage-result")
    workers = {run.name: rows[run.id]["worker"] for run in runs if run.id in rows}
    assert sorted(run.name for run in runs) == EVALUATIONS and all(run.state.is_completed() for run in runs)
    assert sorted(workers) == EVALUATIONS  # each ran on a worker, not in the workspace
    serial_lock = yaml.safe_load((serial / "dvc.lock").read_text())["stages"]
    fanned_lock = yaml.safe_load((launcher / "dvc.lock").read_text())["stages"]
    for stage in EVALUATIONS:
        assert fanned_lock[stage] == serial_lock[stage], stage
    status = json.loads(dvc("status", "--json", *EVALUATIONS, cwd=launcher))
    assert status == {}  # the outputs are in the workspace, as dvc.lock says


def test_a_worker_killed_mid_experiment_crashes_its_run_which_is_retried_from_its_pushed_checkpoint(lab):
    """Runs last in this module: it kills a worker. The sweep's two experiments train SFT-Seen (tiny profile,
    a checkpoint every step), one per worker; once one has pushed a checkpoint to the DVC remote its worker
    is killed, the server marks the run Crashed (its heartbeats stop), and the run goes again on the other
    worker, which pulls the checkpoint and trains only the steps after it. The killed run's private clone is
    then a stale folder that the next run on that clone would remove."""
    from mlflow import MlflowClient
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.experiment import stale_folders
    from flows.workpool import results, timeline

    base, env = lab["base"], lab["env"]
    launcher = base / "crash-launcher"  # a clean clone: the other tests leave their workspaces changed
    git("clone", "-q", str(base / "origin.git"), str(launcher), cwd=base)
    launcher_env = dict(env, PYTHONPATH=str(launcher), PREFECT_HOME=str(launcher / ".prefect"))
    steps = 4   # of 2 sequences each (the profile's 4: twice the time, no more of the path under test)
    sweep = subprocess.Popen([sys.executable, "-m", "flows.sweep", "--target", "sft@seen", "--grid",
                              "sft.lr=3e-3,1e-3", "sft.save_steps=1", f"sft_variants.seen.max_steps={steps}",
                              "sft.batch_size=2", "--pool", POOL], cwd=launcher, env=launcher_env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers = {service.name: service for service in lab["services"] if service.name.startswith("worker-")}
    pushed = base / "parallel-r1-dvc-remote" / "checkpoints"  # <sweep id>/<experiment>/sft_seen/checkpoint-N
    deadline = time.monotonic() + SWEEP_TIMEOUT_S
    marker = None
    while marker is None:  # the first checkpoint an experiment has pushed (its marker is written last)
        assert sweep.poll() is None and time.monotonic() < deadline, sweep.stdout.read()[-3000:]
        time.sleep(1)
        marker = next(pushed.glob("sweep-*/*/sft_seen/checkpoint-*.json"), None)
    running = marker.parent.parent.name
    victim, folder = next((name, folder) for name in workers
                          for folder in (base / name / ".dvc" / "tmp" / "pool").glob("sweep-*")
                          if folder.name.rsplit("-", 1)[0] == running)
    kill_machine(workers[victim].process.pid)
    output, _ = sweep.communicate(timeout=SWEEP_TIMEOUT_S)
    assert sweep.returncode == 0, output[-3000:]
    sweep_id = running.rsplit("-", 1)[0]
    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}):
        runs = timeline(f"sweep:{sweep_id}")
        with get_client(sync_client=True) as client:
            flow_runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"sweep:{sweep_id}"])))
        rows = results([run.id for run in flow_runs])
        unknown = folder.parent / "sweep-0000-000000-1-0123abcd"  # a run this server never had: kept
        unknown.mkdir()
        assert stale_folders(folder.parent / "current-01234567") == [folder]
    for run in runs:
        print(f"{run['name']:<24} {run['worker']:<20} {run['state']:<10} {run['start']} -> {run['end']}")
    states = sorted((run["name"], run["state"]) for run in runs)
    other = next(run["name"] for run in runs if run["name"] != running)
    assert states == sorted([(running, "CRASHED"), (running, "COMPLETED"), (other, "COMPLETED")])
    (retried,) = [run for run in runs if run["name"] == running and run["state"] == "COMPLETED"]
    assert not retried["worker"].endswith(victim)  # the survivor ran it
    by_name = {row["experiment"]: row for row in rows.values()}
    resumed, fresh = by_name[running], by_name[other]
    resumed_step = int(resumed["resumed_from"].rsplit("-", 1)[1])
    assert resumed["resumed_from"].startswith("sft_seen/checkpoint-")
    assert int(marker.stem.rsplit("-", 1)[1]) <= resumed_step < steps  # the one seen, or a later one
    assert resumed["steps"] == fresh["steps"] == steps
    assert resumed["steps_this_run"] == steps - resumed_step and fresh["steps_this_run"] == steps
    assert fresh["resumed_from"] == ""
    print(f"\nresumed from {resumed['resumed_from']}: {resumed['steps_this_run']} of {steps} steps, "
          f"{resumed['train_wall_seconds']} s training; from scratch {fresh['train_wall_seconds']} s")
    assert not any(pushed.glob(f"{sweep_id}/*/*/checkpoint-*"))  # removed once each experiment was pushed
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    experiment_id = client.get_experiment_by_name("parallel-r1").experiment_id
    found = client.search_runs([experiment_id], filter_string=f"tags.sweep_id = '{sweep_id}'")
    finished = sorted(run.data.tags["dvc_exp_name"] for run in found
                      if "dvc_exp_name" in run.data.tags and run.info.status == "FINISHED")
    assert finished == sorted([running, other])
    dvc("exp", "pull", "--no-cache", "origin", cwd=launcher)  # both came back through the git remote
    assert {running, other} <= listed_experiments(launcher)
