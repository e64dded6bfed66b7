"""Bad input stops a stage with one line on stderr naming the file or param and the problem."""

from __future__ import annotations

import json

from conftest import one_line_error, set_param, teacher_row, write_teacher


def test_truncated_generation_file_names_the_line(workdir, capsys):
    from stages.filter import main

    write_teacher(workdir, "gsm8k", json.dumps(teacher_row()) + "\n" + json.dumps(teacher_row(id="g-2"))[:40])
    line = one_line_error(main, capsys)
    assert line.startswith("error: data/teacher/gsm8k.jsonl:2: not valid JSON")


def test_empty_generation_file(workdir, capsys):
    from stages.filter import main

    write_teacher(workdir, "gsm8k", "")
    assert one_line_error(main, capsys) == "error: data/teacher/gsm8k.jsonl: empty file (no rows)"


def test_generation_with_missing_field(workdir, capsys):
    from stages.filter import main

    row = teacher_row()
    del row["ground_truth"]
    write_teacher(workdir, "gsm8k", json.dumps(row) + "\n")
    assert one_line_error(main, capsys) == "error: data/teacher/gsm8k.jsonl:1: missing field(s) ground_truth"


def test_malformed_completion_type(workdir, capsys):
    from stages.filter import main

    write_teacher(workdir, "gsm8k", json.dumps(teacher_row(completion=["not", "text"])) + "\n")
    write_teacher(workdir, "dapo", json.dumps(teacher_row()) + "\n")
    assert one_line_error(main, capsys) == ("error: data/teacher/gsm8k.jsonl:1: field completion must be a "
                                            "string, got list")


def test_negative_sample_count(workdir, capsys):
    from stages.common import load_params
    from stages.generate import main

    set_param(workdir / "params.yaml", "generate_datasets.dapo.limit", "-3")
    assert load_params()["generate_datasets"]["dapo"]["limit"] == -3
    line = one_line_error(main, capsys, ["dapo"])
    assert line == "error: params.yaml generate_datasets.dapo.limit: must be an integer >= 0 or null, got -3"


def test_params_without_a_profile_name(workdir, capsys):
    from stages.prepare_data import main

    (workdir / "params.yaml").write_text("seed: 1\n")
    line = one_line_error(main, capsys)
    assert line == "error: params.yaml: no `profile` name (compose it: python -m stages.profiles <profile>)"


def test_params_naming_an_unknown_profile(workdir, capsys):
    """A bare `dvc repro` runs the stages without `make run`'s profile check: every stage refuses, so dvc.lock
    never records a profile conf/profile/ does not hold."""
    from stages.prepare_data import main

    set_param(workdir / "params.yaml", "profile", "nosuch")
    assert one_line_error(main, capsys) == (
        "error: params.yaml profile: 'nosuch' is not a profile of conf/profile/ (choose from paper, small, "
        "tiny: python -m stages.profiles <profile>)")


def test_unknown_generate_dataset(workdir, capsys):
    from stages.generate import main

    assert one_line_error(main, capsys, ["nope"]).startswith(
        "error: usage: python -m stages.generate <dataset>")
