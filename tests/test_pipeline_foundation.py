"""`dvc repro` of the foundation stages (prepare, generate, filter, validate, Table 1) in a copy of the
repo."""

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


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, mirror):
    repo = copy_repo(tmp_path_factory.mktemp("repo"), mirror)
    # The vLLM path has its own tests; here the tiny teacher generates through transformers.
    set_param(repo / "params.yaml", "generate.engine", "transformers")
    result = dvc(repo, "repro", "table1", "validate")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return repo


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
