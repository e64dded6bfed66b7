"""Dataset sources: the data mirror, data.mirror_dir, and nothing else.

Every source is normalised to one record shape so later stages never care where a
row came from:

    problem: id, question, ground_truth, answer_kind ("gsm8k" | "math"), dataset

`answer_kind` picks the answer checker (numeric for GSM8K, Minerva-normalised for
DAPO and the competition sets). The mirror's layout and where each file is published are in
parallel_r1/data_manifest.yaml; `make data` (parallel_r1/mirror.py) fills the folder and verifies it. Stages
read only that folder, whose files dvc.yaml lists as dependencies: data read from anywhere else (the Hub at
read time, a folder named by an env var) would be data that dvc.lock never recorded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from parallel_r1.errors import PipelineError
from parallel_r1.io import read_jsonl_lines


def _gsm8k_truth(row: dict) -> str:
    """GSM8K stores the answer after `####` in the solution text."""
    if row.get("ground_truth"):
        return str(row["ground_truth"])
    return str(row.get("answer", "")).split("####")[-1].strip().replace(",", "")


@dataclass(frozen=True)
class Source:
    """Where one dataset lives: its mirror file (and, for provenance strings, the dataset it is published
    as)."""

    mirror_file: str
    hub_id: str | None
    answer_kind: str
    question_field: str = "question"
    truth: Callable[[dict], str] = lambda row: str(row.get("ground_truth", row.get("answer", "")))


SOURCES: dict[str, Source] = {
    "gsm8k_train": Source("gsm8k/train.jsonl", "openai/gsm8k", "gsm8k", truth=_gsm8k_truth),
    "gsm8k_test": Source("gsm8k/test.jsonl", "openai/gsm8k", "gsm8k", truth=_gsm8k_truth),
    "dapo": Source("dapo_math_17k.jsonl", "Leo-Dai/dapo-math-17k_dedup", "math", "problem"),
    "aime24": Source("eval/aime24.jsonl", None, "math", "problem"),   # the four: the authors' APO_combine set
    "aime25": Source("eval/aime25.jsonl", None, "math", "problem"),
    "amc23": Source("eval/amc23.jsonl", None, "math", "problem"),
    "math": Source("eval/math300.jsonl", None, "math", "problem"),
    "math500": Source("eval/math500.jsonl", "HuggingFaceH4/MATH-500", "math", "problem"),
}
# The released cold-start generations are outputs of this teacher (the mirror's README).
TEACHER_DEMOS_MODEL = "deepseek-ai/DeepSeek-R1-0528-Qwen3-8B"
TEACHER_DEMOS = Source("teacher_demos_gsm8k.jsonl", "Parallel-R1/Parallel-GSM8K", "gsm8k")


# Problem sets built from other sources (prepare_data's `source` takes these names too).
RELEASED_QUESTIONS = "gsm8k_train_released"
PROBLEM_SETS = (*SOURCES, RELEASED_QUESTIONS)
# Generated, not read (parallel_r1/arithmetic.py): prepare_data's `source` takes it with a level and a split.
GENERATED = "arithmetic"


def mirror_files(name: str) -> frozenset[str]:
    """The mirror files problem set `name` is read from (what its stage must declare as DVC deps)."""
    if name == GENERATED:
        return frozenset()
    if name == RELEASED_QUESTIONS:
        return frozenset({SOURCES["gsm8k_train"].mirror_file, TEACHER_DEMOS.mirror_file})
    return frozenset({SOURCES[name].mirror_file})


def mirror_dir(configured: str | os.PathLike | None) -> Path:
    """The mirror folder, params.yaml data.mirror_dir (stages.common anchors a relative one at the
    project)."""
    if not configured:
        raise PipelineError("params.yaml data.mirror_dir is empty: name the folder `make data` fills "
                            "(mirror)")
    return Path(configured)


def _load_raw(name: str, source: Source, mirror: Path) -> list[tuple[str, dict]]:
    """(where, raw row) from the mirror file, `where` as `<mirror file>:<line>`; one line naming the file
    and `make data` when it is missing."""
    path = mirror / source.mirror_file
    if not path.is_file():
        raise PipelineError(f"dataset {name}: {path} not found; run `make data` (it fills data.mirror_dir "
                            f"from $PARALLEL_R1_DATA, ../shared/data or the datasets' published sources)")
    return [(f"{path}:{lineno}", row) for lineno, row in read_jsonl_lines(path)]


def load_problems(name: str, mirror: str | os.PathLike | None, limit: int | None = None) -> list[dict]:
    """Problems of dataset `name` in the common record shape, the first `limit` rows if given."""
    if name not in PROBLEM_SETS:
        raise PipelineError(f"dataset {name!r} is unknown (choose from {', '.join(PROBLEM_SETS)})")
    if limit is not None and limit < 0:
        raise PipelineError(f"dataset {name}: limit must be >= 0, got {limit}")
    if name == RELEASED_QUESTIONS:
        return released_questions(mirror)[:limit]
    source = SOURCES[name]
    rows = _load_raw(name, source, mirror_dir(mirror))
    problems = []
    for index, (where, row) in enumerate(rows[:limit] if limit is not None else rows):
        question = row.get(source.question_field) or row.get("question") or row.get("problem")
        truth = source.truth(row)
        if not question or not truth:
            field = source.question_field if not question else "ground_truth"
            raise PipelineError(f"{where}: dataset {name}, id {row.get('id', '?')}: missing field {field}")
        problems.append({
            "id": str(row.get("id", f"{name}-{index}")),
            "question": str(question),
            "ground_truth": truth,
            "answer_kind": source.answer_kind,
            "dataset": name,
        })
    return problems


def released_questions(mirror: str | os.PathLike | None) -> list[dict]:
    """The GSM8K train problems that have a released teacher generation, in the release's order.

    These are the questions Parallel-GSM8K (the cold-start SFT set) is built from. The paper's GSM8K
    RL set, all of GSM8K train, contains every SFT question; a small RL subset drawn from these keeps
    that overlap, where the first rows of GSM8K train share almost none with the 300 released. Rows
    carry their GSM8K train id and truth (the release numbers its rows on its own: its
    "gsm8k-train-439" is not GSM8K train row 439), matched by question text.
    """
    train = {problem["question"].strip(): problem for problem in load_problems("gsm8k_train", mirror)}
    problems = []
    for demo in load_teacher_demos(mirror):
        problem = train.get(demo["question"].strip())
        if problem is None:
            raise PipelineError(f"dataset {RELEASED_QUESTIONS}: released demo {demo['id']}'s question is not "
                                f"in GSM8K train ({demo['question'][:60]!r})")
        problems.append(dict(problem, dataset=RELEASED_QUESTIONS))
    return problems


def load_teacher_demos(mirror: str | os.PathLike | None, limit: int | None = None) -> list[dict]:
    """The authors' released zero-shot teacher generations for GSM8K train (300 in the mirror)."""
    rows = _load_raw("teacher_demos_gsm8k", TEACHER_DEMOS, mirror_dir(mirror))
    demos = []
    for index, (where, row) in enumerate(rows[:limit] if limit is not None else rows):
        missing = [f for f in ("question", "completion", "ground_truth") if not row.get(f)]
        if missing:
            raise PipelineError(f"{where}: teacher_demos_gsm8k, id {row.get('id', '?')}: "
                                f"missing field {missing[0]}")
        demos.append({
            "id": str(row.get("id", f"teacher-{index}")),
            "question": row["question"],
            "ground_truth": str(row["ground_truth"]),
            "answer_kind": "gsm8k",
            "dataset": "gsm8k_train",
            "prompt": row.get("prompt") or "",
            "completion": row["completion"],
        })
    return demos
