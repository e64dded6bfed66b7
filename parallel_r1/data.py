"""Dataset sources: an offline mirror directory first, else the Hugging Face Hub.

Every source is normalised to one record shape so later stages never care where a
row came from:

    problem: id, question, ground_truth, answer_kind ("gsm8k" | "math"), dataset

`answer_kind` picks the answer checker (numeric for GSM8K, Minerva-normalised for
DAPO and the competition sets). The mirror layout is that of `../shared/data`
(see its README); the Hub ids are the public datasets it mirrors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from parallel_r1.errors import PipelineError
from parallel_r1.io import read_jsonl_lines

MIRROR_ENV = "PARALLEL_R1_DATA"


def _gsm8k_truth(row: dict) -> str:
    """GSM8K stores the answer after `####` in the solution text."""
    if row.get("ground_truth"):
        return str(row["ground_truth"])
    return str(row.get("answer", "")).split("####")[-1].strip().replace(",", "")


@dataclass(frozen=True)
class Source:
    """Where one dataset lives: a mirror file and the Hub dataset it copies."""

    mirror_file: str
    hub_id: str | None
    hub_config: str | None
    hub_split: str
    answer_kind: str
    question_field: str = "question"
    truth: Callable[[dict], str] = lambda row: str(row.get("ground_truth", row.get("answer", "")))


SOURCES: dict[str, Source] = {
    "gsm8k_train": Source("gsm8k/train.jsonl", "openai/gsm8k", "main", "train", "gsm8k", truth=_gsm8k_truth),
    "gsm8k_test": Source("gsm8k/test.jsonl", "openai/gsm8k", "main", "test", "gsm8k", truth=_gsm8k_truth),
    "dapo": Source("dapo_math_17k.jsonl", "Leo-Dai/dapo-math-17k_dedup", None, "train", "math", "problem"),
    "aime24": Source("eval/aime24.jsonl", "HuggingFaceH4/aime_2024", None, "train", "math", "problem"),
    "aime25": Source("eval/aime25.jsonl", "math-ai/aime25", None, "test", "math", "problem"),
    "amc23": Source("eval/amc23.jsonl", "math-ai/amc23", None, "test", "math", "question"),
    "math": Source("eval/math300.jsonl", None, None, "test", "math", "problem"),
    "math500": Source("eval/math500.jsonl", "HuggingFaceH4/MATH-500", None, "test", "math", "problem"),
}
# The released cold-start generations are outputs of this teacher (the mirror's README).
TEACHER_DEMOS_MODEL = "deepseek-ai/DeepSeek-R1-0528-Qwen3-8B"
TEACHER_DEMOS = Source("teacher_demos_gsm8k.jsonl", "Parallel-R1/Parallel-GSM8K", None, "train", "gsm8k")


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


def mirror_dir(configured: str | os.PathLike | None) -> Path | None:
    """The mirror folder: env PARALLEL_R1_DATA if set, else the param; None = use the Hub.

    Under DVC (env DVC_STAGE: a stage `dvc repro` runs) the env var may not point elsewhere than the
    param: dvc.lock records the hashes of the param's files, so reading another mirror would make the
    lineage lie (`dvc status` up to date on data the stage never read)."""
    override, chosen = os.environ.get(MIRROR_ENV), configured
    if override:
        differs = not configured or Path(override).resolve() != Path(configured).resolve()
        if differs and os.environ.get("DVC_STAGE"):
            raise PipelineError(f"${MIRROR_ENV}={override} differs from params.yaml data.mirror_dir "
                                f"({configured or 'none'}), whose files dvc.lock records: set "
                                f"data.mirror_dir instead (or unset {MIRROR_ENV} under dvc repro)")
        chosen = override
    return Path(chosen) if chosen else None


def _load_raw(name: str, source: Source, mirror: Path | None) -> list[tuple[str, dict]]:
    """(where, raw row) from the mirror file, else the Hub; one error naming both when neither works.

    `where` names a row as its file shows it: `<mirror file>:<line>`, or `<hub id> row <n>` (from 1).
    """
    looked = []
    if mirror is not None:
        path = mirror / source.mirror_file
        if path.is_file():
            return [(f"{path}:{lineno}", row) for lineno, row in read_jsonl_lines(path)]
        looked.append(f"mirror {path} (missing)")
    else:
        looked.append(f"mirror (none configured: params.yaml data.mirror_dir or ${MIRROR_ENV})")
    if source.hub_id is None:
        looked.append("Hub (no public Hub copy of this set)")
    else:
        try:
            import datasets

            rows = datasets.load_dataset(source.hub_id, source.hub_config, split=source.hub_split)
            return [(f"{source.hub_id} row {index}", dict(row)) for index, row in enumerate(rows, start=1)]
        except Exception as err:  # offline, missing, renamed: all mean "not available here"
            reason = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
            looked.append(f"Hub {source.hub_id} ({reason})")
    raise PipelineError(f"dataset {name}: not available — looked in " + "; ".join(looked))


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
