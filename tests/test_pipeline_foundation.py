"""The foundation stages (prepare, generate, filter, validate, Table 1) in a copy of the repo on the tiny
profile, run as `make run` runs them: the Prefect flow `reproduce`, one task run per stage, over a temporary
local Prefect server (no PREFECT_API_URL) whose database is the copy's .prefect/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import copy_repo, set_param
from parallel_r1.format import rollout_layout
from parallel_r1.io import read_jsonl

pytestmark = pytest.mark.slow


def dvc(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PARALLEL_R1_TRACKING": "off"}
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=env, capture_output=True,
                          text=True)


def prefect_env(repo: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    return {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PARALLEL_R1_TRACKING": "off", "PREFECT_HOME": str(repo / ".prefect"),
            "PYTHONPATH": str(repo), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, mirror):
    repo = copy_repo(tmp_path_factory.mktemp("repo"), mirror)
    # The vLLM path has its own tests; here the tiny teacher generates through transformers.
    set_param(repo / "params.yaml", "generate.engine", "transformers")
    result = subprocess.run([sys.executable, "-m", "flows.reproduce", "table1", "validate"], cwd=repo,
                            env=prefect_env(repo), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return repo


FLOW_RUNS = """
import json
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

with get_client(sync_client=True) as client:
    runs = []
    for flow_run in client.read_flow_runs():
        only = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id]))
        tasks = client.read_task_runs(flow_run_filter=only)
        runs.append({"flow": client.read_flow(flow_run.flow_id).name, "state": flow_run.state.type.value,
                     "tasks": sorted([t.name, t.state.type.value] for t in tasks)})
    print(json.dumps(runs))
"""


def test_the_run_is_a_prefect_flow_run_with_one_task_run_per_stage(pipeline):
    """What `make ui` shows afterwards: the flow run of `reproduce`, completed, a task run per DVC stage."""
    shown = subprocess.run([sys.executable, "-c", FLOW_RUNS], cwd=pipeline, env=prefect_env(pipeline),
                           capture_output=True, text=True, timeout=600)
    assert shown.returncode == 0, shown.stderr[-3000:]
    (run,) = json.loads(shown.stdout.strip().splitlines()[-1])
    stages = ["prepare_model", "prepare_data", "generate@gsm8k", "generate@dapo", "filter", "table1",
              "validate"]
    assert (run["flow"], run["state"]) == ("reproduce", "COMPLETED")
    assert run["tasks"] == sorted([stage, "COMPLETED"] for stage in stages)


def test_table1_is_rebuilt_from_the_filter_metrics(pipeline):
    gsm8k = json.loads((pipeline / "metrics/filter/gsm8k.json").read_text())
    dapo = json.loads((pipeline / "metrics/filter/dapo.json").read_text())
    assert gsm8k["examples"] == 300 and gsm8k["valid"] >= 290
    assert dapo["examples"] == 8 and dapo["source"] == "model"
    table = (pipeline / "reports/table1.md").read_text()
    assert "83.7" in table and f"{gsm8k['valid_pct']:.1f}" in table


def test_sft_set_and_validation_reports(pipeline):
    rows = read_jsonl(pipeline / "data/sft/parallel_gsm8k.jsonl")
    gsm8k = json.loads((pipeline / "metrics/filter/gsm8k.json").read_text())
    assert len(rows) == gsm8k["kept"] > 0
    teacher = {r["id"]: r for r in read_jsonl(pipeline / "data/teacher/gsm8k.jsonl")}
    assert all(r["completion"] == rollout_layout(teacher[r["id"]]["completion"]) for r in rows)
    assert sum(r["completion"] != teacher[r["id"]]["completion"] for r in rows) > 0
    summary = (pipeline / "reports/validation/summary.md").read_text()
    for name in ("teacher_gsm8k", "teacher_dapo", "sft_parallel_gsm8k", "rl_gsm8k", "eval_aime24"):
        assert name in summary


def test_second_repro_does_nothing(pipeline):
    result = dvc(pipeline, "repro", "table1", "validate")
    assert result.returncode == 0
    assert "didn't change, skipping" in result.stdout and "Running stage" not in result.stdout


def test_zero_row_sft_set_stops_the_filter(pipeline, tmp_path):
    teacher = pipeline / "data/teacher/gsm8k.jsonl"
    original = teacher.read_text()
    try:
        broken = [json.loads(line) for line in original.split("\n") if line]
        for row in broken:
            row["completion"] = row["completion"].replace("</Parallel>", "")
        teacher.write_text("".join(json.dumps(r) + "\n" for r in broken))
        env = {**os.environ, "PARALLEL_R1_TRACKING": "off"}
        result = subprocess.run([sys.executable, "-m", "stages.filter"], cwd=pipeline, env=env,
                                capture_output=True, text=True)
        assert result.returncode == 1
        assert result.stderr.strip().splitlines()[-1].startswith(
            "error: data/teacher/gsm8k.jsonl: the filter kept 0")
    finally:
        teacher.write_text(original)
