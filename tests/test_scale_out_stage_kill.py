"""Scale-out, a machine lost under a fanned-out stage: `make run POOL=...` of the two SFT stages on two
workers, one worker killed mid-stage, the stage resumed on the other. In a lab of its own
(tests/scale_out_lab.py), so it runs beside tests/test_scale_out.py on another pytest worker.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml

from tests.conftest import set_param
from tests.scale_out_lab import POOL, SWEEP_TIMEOUT_S, dvc, git, kill_machine, make_data, open_lab

pytestmark = [pytest.mark.server, pytest.mark.slow]
_lab = pytest.fixture(scope="module", name="lab")(open_lab)


def test_a_fanned_out_stage_whose_worker_dies_is_retried_and_resumes_to_the_model_of_a_serial_run(lab):
    """`make run POOL=...` (flows.reproduce --pool) of SFT-Seen and SFT-Unseen, one per worker, a checkpoint
    each step; once one has pushed a checkpoint its worker is killed: the stage's run is marked Crashed,
    launched again on the other worker, resumes from the checkpoint, and the pipeline completes with the
    model (and dvc.lock's record of it) of a serial `dvc repro` of the killed stage on the same inputs, run
    after it in the launcher. The launcher's params.yaml is not committed: the fanned-out stages run it all
    the same (the commit is made aside)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.workpool import results

    base, env = lab["base"], lab["env"]
    stages = ["sft@seen", "sft@unseen"]
    launcher = base / "fanout-launcher"
    git("clone", "-q", str(base / "origin.git"), str(launcher), cwd=base)
    make_data(launcher, env)
    # a checkpoint every step, 3 steps: one to resume from and steps after it
    for key, value in {"sft.save_steps": "1", "sft_variants.seen.max_steps": "3",
                       "sft_variants.unseen.max_steps": "3"}.items():
        set_param(launcher / "params.yaml", key, value)
    dvc("repro", "validate", cwd=launcher)   # the inputs; only the two SFT stages fan out
    launcher_env = dict(env, PYTHONPATH=str(launcher), PREFECT_HOME=str(launcher / ".prefect"))
    fanned = subprocess.Popen([sys.executable, "-m", "flows.reproduce", *stages, "--pool", POOL],
                              cwd=launcher, env=launcher_env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    workers = {service.name: service for service in lab["services"] if service.name.startswith("worker-")}
    pushed = base / "parallel-r1-dvc-remote" / "checkpoints"   # <reproduce id>/<stage>/<folder>/checkpoint-*
    deadline = time.monotonic() + SWEEP_TIMEOUT_S
    marker = None
    while marker is None:
        assert fanned.poll() is None and time.monotonic() < deadline, fanned.stdout.read()[-3000:]
        time.sleep(1)
        marker = next(pushed.glob("reproduce-*/sft_*/sft_*/checkpoint-*.json"), None)
    killed_stage = marker.parent.parent.name.replace("_", "@", 1)
    victim = next(name for name in workers
                  if any((base / name / ".dvc" / "tmp" / "pool").glob(f"{marker.parent.parent.name}-*")))
    kill_machine(workers[victim].process.pid)
    output, _ = fanned.communicate(timeout=SWEEP_TIMEOUT_S)
    assert fanned.returncode == 0, output[-3000:]
    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}), \
            get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=stages)))
        rows = results([run.id for run in runs], "stage-result")
    states = sorted((run.name, run.state.type.value) for run in runs)
    other = next(stage for stage in stages if stage != killed_stage)
    assert states == sorted([(killed_stage, "CRASHED"), (killed_stage, "COMPLETED"), (other, "COMPLETED")])
    (retried,) = [rows[run.id] for run in runs if run.name == killed_stage and run.id in rows]
    assert retried["resumed_from"].startswith(marker.parent.name + "/checkpoint-")
    assert not retried["worker"].endswith(victim)
    assert not any(pushed.glob("reproduce-*/*/*/checkpoint-*"))   # removed once the outputs were pushed
    assert json.loads(dvc("status", "--json", *stages, cwd=launcher)) == {}
    fanned_locks = yaml.safe_load((launcher / "dvc.lock").read_text())["stages"]
    assert not any((launcher / "checkpoints").glob("sft_*/checkpoint-*"))  # the serial runs start afresh
    # the killed stage again, serially, here, on the same inputs (a fanned-out stage that ran undisturbed
    # matching a serial run is tests/test_scale_out.py's fan-out check)
    dvc("repro", "--force", "--single-item", killed_stage, cwd=launcher)
    fanned_lock = fanned_locks[killed_stage]
    serial_lock = yaml.safe_load((launcher / "dvc.lock").read_text())["stages"][killed_stage]
    models = [[out for out in lock["outs"] if out["path"].startswith("models/")]
              for lock in (fanned_lock, serial_lock)]
    assert models[0] == models[1] and fanned_lock["deps"] == serial_lock["deps"]
