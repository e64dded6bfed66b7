"""A failing run neither loses nor half-publishes outputs: checks come first, writes are atomic and
all-or-nothing, and every DVC output is in the cache so `dvc checkout` restores it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import copy_repo, set_param, teacher_row, write_teacher

REPO = Path(__file__).resolve().parents[1]


def write_teachers(root: Path, gsm8k: str, dapo: str) -> None:
    write_teacher(root, "gsm8k", gsm8k)
    write_teacher(root, "dapo", dapo)


OUTPUTS = ("metrics/filter/gsm8k.json", "metrics/filter/dapo.json", "data/sft/parallel_gsm8k.jsonl")


@pytest.fixture
def filtered(workdir):
    """A project folder where the filter has run once: its outputs are the 'previous' ones."""
    from stages.filter import main

    write_teachers(workdir, json.dumps(teacher_row()) + "\n", json.dumps(teacher_row(id="d-1")) + "\n")
    main()
    return {name: (workdir / name).read_bytes() for name in OUTPUTS}


@pytest.mark.parametrize("broken", ["zero_kept", "bad_second_file"])
def test_failing_filter_leaves_every_previous_output_in_place(filtered, tmp_path, capsys, broken):
    from stages.filter import main

    unformatted = json.dumps(teacher_row(completion="no block\nFinal Answer: 3")) + "\n"
    if broken == "zero_kept":          # used to write an empty SFT file, then raise
        write_teachers(tmp_path, unformatted, json.dumps(teacher_row(id="d-1")) + "\n")
    else:                              # used to replace gsm8k's metrics, then fail on dapo's file
        write_teachers(tmp_path, unformatted + json.dumps(teacher_row(id="g-2")) + "\n",
                       '{"id": "d-1", "ques')
    with pytest.raises(SystemExit):
        main()
    assert capsys.readouterr().err.startswith("error: data/teacher/")
    assert {name: (tmp_path / name).read_bytes() for name in OUTPUTS} == filtered
    assert not [p for p in tmp_path.rglob(".*") if p.is_file()]   # no temporary file left behind


def test_every_dvc_output_is_cached_so_checkout_restores_it():
    """/metrics and /reports are git-ignored: an uncached output there could never be restored."""
    from dvc.repo import Repo

    with Repo(str(REPO)) as repo:
        uncached = [f"{stage.addressing}: {out.def_path}" for stage in repo.index.stages
                    for out in stage.outs if not out.use_cache]
    assert uncached == []


def test_bad_dataset_entry_names_its_param_path_before_any_dataset_is_read(workdir, monkeypatch, capsys):
    from stages.prepare_data import main

    tmp_path = workdir
    set_param(tmp_path / "params.yaml", "data.eval.math.limit", "-2")
    monkeypatch.setenv("PARALLEL_R1_DATA", str(tmp_path / "no-mirror"))   # reading anything would fail
    with pytest.raises(SystemExit):
        main()
    assert capsys.readouterr().err.strip() == ("error: params.yaml data.eval.math.limit: "
                                               "must be an integer >= 1 "
                                               "or null, got -2")
    assert not (tmp_path / "data").exists()


def dvc(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PARALLEL_R1_TRACKING": "off",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=env, capture_output=True,
                          text=True)


@pytest.mark.slow
def test_metrics_deleted_by_a_failed_repro_come_back_with_dvc_checkout(tmp_path, mirror):
    repo = copy_repo(tmp_path / "repo", mirror)
    write_teachers(repo, json.dumps(teacher_row()) + "\n", json.dumps(teacher_row(id="d-1")) + "\n")
    first = dvc(repo, "repro", "--single-item", "filter")
    assert first.returncode == 0, first.stderr[-2000:]
    before = {name: (repo / name).read_bytes() for name in OUTPUTS}

    set_param(repo / "params.yaml", "filter.max_tokens", "-1")   # a params typo: the stage stops at once
    failed = dvc(repo, "repro", "--single-item", "filter")
    assert failed.returncode != 0 and "filter.max_tokens: must be >= 1" in failed.stdout + failed.stderr
    assert not (repo / OUTPUTS[0]).exists()                      # DVC removed them before running

    restored = dvc(repo, "checkout", "filter")
    assert restored.returncode == 0, restored.stderr[-2000:]
    assert {name: (repo / name).read_bytes() for name in OUTPUTS} == before


# ---------------------------------------------------------------- killed runs in MLflow

KILLED_STAGE = """
import os, signal
from parallel_r1 import tracking
with tracking.stage_run("sft", "seen", params={"profile": "tiny"}):
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_run_killed_with_sigkill_is_closed_by_the_next_run_of_its_stage(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from parallel_r1 import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "killed")
    monkeypatch.delenv("PARALLEL_R1_TRACKING", raising=False)
    monkeypatch.delenv("PARALLEL_R1_PARENT_RUN_ID", raising=False)
    child = subprocess.run([sys.executable, "-c", KILLED_STAGE], env={**os.environ, "PYTHONPATH": str(REPO)},
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == -9, child.stderr[-2000:]
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("killed").experiment_id
    [orphan] = client.search_runs([experiment], "attributes.status = 'RUNNING'")
    with tracking.stage_run("sft", "unseen", params={"profile": "tiny"}) as other:   # another stage: kept
        assert client.get_run(orphan.info.run_id).info.status == "RUNNING"
        assert tracking.close_orphaned_runs() == [orphan.info.run_id]                  # `make ui` closes all
        assert client.get_run(other).info.status == "RUNNING"                          # a live run stays
    assert client.get_run(orphan.info.run_id).info.status == "KILLED"

    client.set_terminated(orphan.info.run_id, status="RUNNING")
    with tracking.stage_run("sft", "seen", params={"profile": "tiny"}):              # the same stage again
        assert client.get_run(orphan.info.run_id).info.status == "KILLED"
