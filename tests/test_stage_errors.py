"""Bad input stops a stage with one line on stderr naming the file or param and the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PARALLEL_R1_TRACKING", "off")
    return tmp_path


def run_stage(main, capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(*args)
    assert exit_info.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def teacher_row(**changes) -> dict:
    row = {"id": "g-1", "question": "q", "ground_truth": "3", "answer_kind": "gsm8k", "dataset": "gsm8k_train",
           "prompt": "p", "completion": "<Parallel><Path>a</Path><Path>b</Path></Parallel><Summary>s</Summary>\n"
           "Final Answer: 3", "source": "model", "model": "m", "completion_tokens": 20, "truncated": False}
    return {**row, **changes}


def write_teacher(workdir: Path, name: str, text: str) -> None:
    path = workdir / "data" / "teacher" / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_truncated_generation_file_names_the_line(workdir, capsys):
    from stages.filter import main

    write_teacher(workdir, "gsm8k", json.dumps(teacher_row()) + "\n" + json.dumps(teacher_row(id="g-2"))[:40])
    line = run_stage(main, capsys)
    assert line.startswith("error: data/teacher/gsm8k.jsonl:2: not valid JSON")


def test_empty_generation_file(workdir, capsys):
    from stages.filter import main

    write_teacher(workdir, "gsm8k", "")
    assert run_stage(main, capsys) == "error: data/teacher/gsm8k.jsonl: empty file (no rows)"


def test_generation_with_missing_field(workdir, capsys):
    from stages.filter import main

    row = teacher_row()
    del row["ground_truth"]
    write_teacher(workdir, "gsm8k", json.dumps(row) + "\n")
    assert run_stage(main, capsys) == "error: data/teacher/gsm8k.jsonl:1: missing field(s) ground_truth"


def test_malformed_completion_type(workdir, capsys):
    from stages.filter import main

    write_teacher(workdir, "gsm8k", json.dumps(teacher_row(completion=["not", "text"])) + "\n")
    write_teacher(workdir, "dapo", json.dumps(teacher_row()) + "\n")
    assert run_stage(main, capsys) == "error: data/teacher/gsm8k.jsonl:1: field completion must be a string, got list"


def test_negative_sample_count(workdir, capsys):
    from stages.common import load_params
    from stages.generate import main

    params = (workdir / "params.yaml").read_text()
    (workdir / "params.yaml").write_text(params.replace("dapo: {limit: 8}", "dapo: {limit: -3}"))
    assert load_params()["generate_datasets"]["dapo"]["limit"] == -3
    line = run_stage(main, capsys, ["dapo"])
    assert line == "error: params.yaml generate_datasets.dapo.limit: must be an integer >= 0 or null, got -3"


def test_unknown_profile(workdir, capsys):
    from stages.prepare_data import main

    params = (workdir / "params.yaml").read_text()
    (workdir / "params.yaml").write_text(params.replace("profile: small ", "profile: huge ", 1))
    line = run_stage(main, capsys)
    assert line == "error: params.yaml profile: unknown profile 'huge' (choose from paper, small, tiny)"


def test_unknown_generate_dataset(workdir, capsys):
    from stages.generate import main

    assert run_stage(main, capsys, ["nope"]).startswith("error: usage: python -m stages.generate <dataset>")
