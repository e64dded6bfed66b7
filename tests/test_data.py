"""Dataset sources: offline mirror, record shape, and one clear error when nothing is available."""

from __future__ import annotations

import json

import pytest

from parallel_r1.data import PROBLEM_SETS, load_problems, load_teacher_demos
from parallel_r1.errors import PipelineError
from parallel_r1.io import read_jsonl

EXPECTED_ROWS = {"gsm8k_train": 7473, "gsm8k_train_released": 300, "gsm8k_test": 1319, "dapo": 17917,
                 "aime24": 30, "aime25": 30, "amc23": 40, "math": 316, "math500": 500}


@pytest.mark.parametrize("name", sorted(PROBLEM_SETS))
def test_every_dataset_loads_offline_in_the_common_shape(name, mirror):
    problems = load_problems(name, mirror)
    assert len(problems) == EXPECTED_ROWS[name]
    assert len({p["id"] for p in problems}) == len(problems)
    for problem in problems[:50]:
        assert set(problem) == {"id", "question", "ground_truth", "answer_kind", "dataset"}
        assert problem["question"].strip() and problem["ground_truth"].strip()
        assert problem["answer_kind"] == ("gsm8k" if name.startswith("gsm8k") else "math")


def test_gsm8k_ground_truth_is_the_number_after_hashes(mirror):
    first = load_problems("gsm8k_train", mirror, limit=1)[0]
    assert first["ground_truth"] == "72"


def test_released_questions_are_the_teacher_demos_questions_of_gsm8k_train(mirror):
    """The small profile's GSM8K RL prompts: the questions the SFT set is built from, GSM8K train's truths."""
    released = load_problems("gsm8k_train_released", mirror)
    demos = load_teacher_demos(mirror)
    assert [p["question"].strip() for p in released] == [d["question"].strip() for d in demos]
    train = {p["id"]: p for p in load_problems("gsm8k_train", mirror)}
    for problem, demo in zip(released, demos, strict=True):
        assert problem["question"] == train[problem["id"]]["question"]  # its GSM8K train id, not the demo's
        assert problem["ground_truth"] == train[problem["id"]]["ground_truth"] == demo["ground_truth"]
    assert load_problems("gsm8k_train_released", mirror, limit=2) == released[:2]


def test_limit_takes_the_first_rows(mirror):
    assert [p["id"] for p in load_problems("aime24", mirror, limit=3)] == ["aime24-0", "aime24-1", "aime24-2"]
    with pytest.raises(PipelineError, match="limit must be >= 0"):
        load_problems("aime24", mirror, limit=-1)


def test_teacher_demos_keep_prompt_and_completion(mirror):
    demos = load_teacher_demos(mirror)
    assert len(demos) == 300
    assert all(d["completion"] and d["prompt"] for d in demos)


def test_a_missing_mirror_file_names_it_and_make_data(tmp_path):
    """The mirror is the one place stages read data from: no Hub download at read time, which DVC could not
    track."""
    with pytest.raises(PipelineError) as err:
        load_problems("gsm8k_test", tmp_path)
    message = str(err.value)
    assert "\n" not in message and "Hub" not in message
    missing = tmp_path / "gsm8k/test.jsonl"
    assert message.startswith(f"dataset gsm8k_test: {missing} not found; run `make data`")
    with pytest.raises(PipelineError, match=r"^params.yaml data.mirror_dir is empty"):
        load_problems("gsm8k_test", "")


def test_the_env_var_is_where_make_data_copies_from_not_where_stages_read(tmp_path, monkeypatch, mirror):
    """dvc.lock records the hashes of data.mirror_dir's files: a stage reading the folder PARALLEL_R1_DATA
    names would make `dvc status` say up to date on data the stage never read."""
    monkeypatch.setenv("PARALLEL_R1_DATA", str(mirror))
    monkeypatch.setenv("DVC_STAGE", "prepare_data")
    with pytest.raises(PipelineError, match=r"aime25.jsonl not found; run `make data`"):
        load_problems("aime25", tmp_path / "nowhere")
    assert len(load_problems("aime25", mirror)) == 30


def test_unknown_dataset_and_missing_fields(tmp_path, monkeypatch):
    with pytest.raises(PipelineError, match="unknown"):
        load_problems("nope", tmp_path)
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "aime24.jsonl").write_text(json.dumps({"id": "x", "problem": "q"}) + "\n")
    with pytest.raises(PipelineError,
                       match=r"aime24.jsonl:1: dataset aime24, id x: missing field ground_truth"):
        load_problems("aime24", tmp_path)


def test_truncated_and_empty_files_fail_with_the_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": 1}\n{"id": 2, "question": "trunc')
    with pytest.raises(PipelineError, match=r"rows.jsonl:2: not valid JSON"):
        read_jsonl(path)
    path.write_text("")
    with pytest.raises(PipelineError, match="empty file"):
        read_jsonl(path)


def test_a_json_error_says_where_on_the_line_in_a_whole_sentence(tmp_path):
    """json's message for a raw control character is "Invalid control character at": the column completes
    it."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n{"question": "two\tcolumns"}\n')
    with pytest.raises(PipelineError, match=r"rows.jsonl:2: not valid JSON "
                                            r"\(Invalid control character at column 18\); truncated file\?$"):
        read_jsonl(path)
