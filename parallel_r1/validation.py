"""Great Expectations suites for every dataset the pipeline writes, and readable reports.

Four kinds of JSONL dataset (record schemas in the team brief):
  - "rl" and "eval": problems (`id, question, ground_truth, answer_kind, dataset`);
  - "teacher": problems plus the teacher's output (`prompt, completion, source, model,
    completion_tokens, truncated`);
  - "sft": teacher outputs that passed the format filter.
Each suite checks the schema (columns and types), non-null fields, that the answer is there,
length bounds, unique ids and duplicate questions (a warning by default: the authors' DAPO copy
holds a few hundred repeated problems). The SFT suite also asks for tag balance: every row passes
Algorithm 1 with at least one block, opening and closing tags pair up, a numeric `Final Answer:`
and `completion_tokens` within the SFT token cap. Raw teacher outputs are allowed to fail the
format (Table 1: DAPO 0.0% valid); for them the format rate is reported as a statistic only.

Row-level facts Great Expectations cannot compute itself (Algorithm 1, tag counts, the final
answer line) are derived as helper columns with pandas first, and the suites expect on them.
Great Expectations is imported lazily (it takes seconds), with analytics and progress bars off.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Literal

import pandas as pd

from parallel_r1.config import check_fields
from parallel_r1.format import (
    PARALLEL_CLOSE,
    PARALLEL_OPEN,
    PATH_CLOSE,
    PATH_OPEN,
    SUMMARY_CLOSE,
    SUMMARY_OPEN,
    TAGS,
    check_format,
)
from parallel_r1.io import atomic_path
from parallel_r1.rewards import ANSWER_KINDS, extract_final_answer, strip_tags

if TYPE_CHECKING:
    import great_expectations as gx

Kind = Literal["teacher", "sft", "rl", "eval"]
KINDS: tuple[str, ...] = ("teacher", "sft", "rl", "eval")
SOURCES = ("released", "model")

PROBLEM_SCHEMA = {"id": "str", "question": "str", "ground_truth": "str", "answer_kind": "str",
                  "dataset": "str"}
TEACHER_SCHEMA = {**PROBLEM_SCHEMA, "prompt": "str", "completion": "str", "source": "str", "model": "str",
                  "completion_tokens": "int", "truncated": "bool"}
SCHEMAS = {"rl": PROBLEM_SCHEMA, "eval": PROBLEM_SCHEMA, "teacher": TEACHER_SCHEMA, "sft": TEACHER_SCHEMA}

# Helper columns derived with pandas before validation, and the column each is derived from.
QUESTION_KEY = "question_normalized"
PROMPT_HAS_QUESTION = "prompt_has_question"
FORMAT_CHECK = "format_check"
FINAL_ANSWER = "final_answer"
TAG_PAIRS = ((PARALLEL_OPEN, PARALLEL_CLOSE), (PATH_OPEN, PATH_CLOSE), (SUMMARY_OPEN, SUMMARY_CLOSE),
             (PARALLEL_CLOSE, SUMMARY_OPEN))  # balanced tags, and #<Summary> = #</Parallel>
TAG_COUNTS = {tag: "n_" + tag.strip("</>").lower() + ("_close" if tag.startswith("</") else "_open")
              for tag in TAGS}
DERIVED_FROM = {QUESTION_KEY: "question", PROMPT_HAS_QUESTION: "prompt", FORMAT_CHECK: "completion",
                FINAL_ANSWER: "completion", **{column: "completion" for column in TAG_COUNTS.values()}}
FORMAT_OK = "ok"
NON_BLANK = r"\S"


@dataclass(frozen=True)
class ValidationConfig:
    """Bounds and switches of the dataset suites (params.yaml `validate`; every key optional).

    Rows and questions (every kind):
        min_rows: fewest rows a dataset may hold (an empty dataset always fails).
        max_question_chars: longest question accepted, in characters.
        max_ground_truth_chars: longest ground truth accepted (a longer one is usually a whole
            solution stored by mistake).
        duplicate_questions: "warn" flags repeated questions without failing the suite (the
            authors' DAPO copy repeats a few hundred problems); "fail" makes them a failure.
    Completions (teacher outputs and the SFT set):
        max_completion_chars: longest completion accepted, in characters.
        min_completion_chars: shortest SFT completion. Raw teacher completions may be empty
            (a response whose thinking never closed is kept empty, so Table 1 counts it).
        max_teacher_completion_tokens: bound on `completion_tokens` of raw teacher outputs.
        sft_max_tokens: the SFT token cap on `completion_tokens` (paper: 4096; = filter.max_tokens).
    Reports:
        max_offending_rows: offending rows kept per expectation.
        max_value_chars: offending values are cut to this many characters.
    """

    min_rows: int = field(default=1, metadata={"min": 1})
    max_question_chars: int = field(default=20_000, metadata={"min": 1})
    max_ground_truth_chars: int = field(default=256, metadata={"min": 1})
    duplicate_questions: Literal["warn", "fail"] = "warn"
    max_completion_chars: int = field(default=200_000, metadata={"min": 1})
    min_completion_chars: int = field(default=1, metadata={"min": 0})
    max_teacher_completion_tokens: int = field(default=32_768, metadata={"min": 1})
    sft_max_tokens: int = field(default=4096, metadata={"min": 1})
    max_offending_rows: int = field(default=5, metadata={"min": 1})
    max_value_chars: int = field(default=120, metadata={"min": 10})

    def __post_init__(self) -> None:
        check_fields(self)


# ---------------------------------------------------------------- derived columns


def derive_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """A copy of `frame` with the helper columns its source columns allow."""
    frame = frame.copy()
    if "question" in frame:
        frame[QUESTION_KEY] = frame["question"].map(
            lambda q: " ".join(q.split()) if isinstance(q, str) else None)
    if "prompt" in frame and "question" in frame:
        frame[PROMPT_HAS_QUESTION] = [q.strip() in p if isinstance(p, str) and isinstance(q, str) else None
                                      for p, q in zip(frame["prompt"], frame["question"], strict=True)]
    if "completion" in frame:  # null where the completion is not text: only its own checks fail then
        texts = [text if isinstance(text, str) else None for text in frame["completion"]]
        results = [check_format(text) if text is not None else None for text in texts]
        frame[FORMAT_CHECK] = [None if r is None else FORMAT_OK if r else f"{r.reason}: {r.detail}"
                               for r in results]
        frame[FINAL_ANSWER] = [None if t is None else extract_final_answer(strip_tags(t)) or ""
                               for t in texts]
        for tag, column in TAG_COUNTS.items():
            frame[column] = pd.array([None if t is None else t.count(tag) for t in texts], dtype="Int64")
    return frame


# ---------------------------------------------------------------- suites


_BATCH_DEFINITION = None


def _gx():
    """Great Expectations, imported on first use with analytics and progress bars off.

    Suites need a current data context, and every validation shares one in-memory context
    with a whole-dataframe batch definition, so both are made here once.
    """
    global _BATCH_DEFINITION
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import great_expectations as gx

    if _BATCH_DEFINITION is None:
        from great_expectations.data_context.types.base import (
            DataContextConfig,
            InMemoryStoreBackendDefaults,
            ProgressBarsConfig,
        )

        project = DataContextConfig(analytics_enabled=False,
                                    store_backend_defaults=InMemoryStoreBackendDefaults(),
                                    progress_bars=ProgressBarsConfig(globally=False,
                                                                     metric_calculations=False))
        context = gx.get_context(mode="ephemeral", project_config=project)
        asset = context.data_sources.add_pandas("parallel_r1").add_dataframe_asset("jsonl_rows")
        _BATCH_DEFINITION = asset.add_batch_definition_whole_dataframe("whole_file")
    return gx


def build_suite(kind: Kind, config: ValidationConfig) -> "gx.ExpectationSuite":
    """The expectation suite of one dataset kind, bounds taken from `config`."""
    if kind not in SCHEMAS:
        raise ValueError(f"unknown dataset kind {kind!r} (choose from {', '.join(KINDS)})")
    gx = _gx()
    E = gx.expectations
    warn_or_fail = "warning" if config.duplicate_questions == "warn" else "critical"
    expectations = [E.ExpectTableRowCountToBeBetween(min_value=config.min_rows)]
    for column, type_ in SCHEMAS[kind].items():
        expectations += [E.ExpectColumnToExist(column=column), E.ExpectColumnValuesToNotBeNull(column=column),
                         E.ExpectColumnValuesToBeOfType(column=column, type_=type_)]
    expectations += [
        E.ExpectColumnValuesToBeUnique(column="id"),
        E.ExpectColumnValuesToMatchRegex(column="id", regex=NON_BLANK),
        E.ExpectColumnValuesToMatchRegex(column="question", regex=NON_BLANK),
        E.ExpectColumnValueLengthsToBeBetween(column="question", max_value=config.max_question_chars),
        E.ExpectColumnValuesToMatchRegex(column="ground_truth", regex=NON_BLANK),
        E.ExpectColumnValueLengthsToBeBetween(column="ground_truth", max_value=config.max_ground_truth_chars),
        E.ExpectColumnValuesToBeInSet(column="answer_kind", value_set=list(ANSWER_KINDS)),
        E.ExpectColumnValuesToMatchRegex(column="dataset", regex=NON_BLANK),
        E.ExpectColumnValuesToBeUnique(column=QUESTION_KEY, severity=warn_or_fail),
    ]
    if kind in ("teacher", "sft"):
        sft = kind == "sft"
        expectations += [
            E.ExpectColumnValuesToMatchRegex(column="prompt", regex=NON_BLANK),
            E.ExpectColumnValuesToBeInSet(column=PROMPT_HAS_QUESTION, value_set=[True]),
            E.ExpectColumnValuesToBeInSet(column="source", value_set=list(SOURCES)),
            E.ExpectColumnValuesToMatchRegex(column="model", regex=NON_BLANK),
            E.ExpectColumnValueLengthsToBeBetween(column="completion", max_value=config.max_completion_chars,
                                                  min_value=config.min_completion_chars if sft else 0),
            E.ExpectColumnValuesToBeBetween(
                column="completion_tokens", min_value=1 if sft else 0,
                max_value=config.sft_max_tokens if sft else config.max_teacher_completion_tokens),
        ]
    if kind == "sft":
        expectations += [
            E.ExpectColumnValuesToBeInSet(column=FORMAT_CHECK, value_set=[FORMAT_OK]),
            *(E.ExpectColumnPairValuesToBeEqual(column_A=TAG_COUNTS[opening], column_B=TAG_COUNTS[closing])
              for opening, closing in TAG_PAIRS),
            E.ExpectColumnValuesToMatchRegex(column=FINAL_ANSWER, regex=r"\d"),
            E.ExpectColumnValuesToBeInSet(column="truncated", value_set=[False]),
        ]
    for index, expectation in enumerate(expectations):
        expectation.meta = {"order": index}
    return gx.ExpectationSuite(name=f"parallel_r1_{kind}", expectations=expectations)


# ---------------------------------------------------------------- results


@dataclass
class OffendingRow:
    """A row that broke an expectation: 1-based position in the file, its `id`, the value (cut)."""

    row: int
    id: str | None
    value: str


@dataclass
class ExpectationOutcome:
    """One expectation's result; status is passed, failed, warning (non-critical) or skipped."""

    expectation: str
    columns: list[str]
    status: str
    bounds: dict[str, Any] = field(default_factory=dict)
    severity: str = "critical"
    unexpected_count: int | None = None
    observed: str | None = None
    offending: list[OffendingRow] = field(default_factory=list)
    note: str = ""

    def describe(self) -> str:
        bounds = "".join(f"; {key}={value}" for key, value in self.bounds.items())
        where = f"({', '.join(self.columns)}{bounds})" if self.columns or bounds else ""
        count = f": {self.unexpected_count} row(s)" if self.unexpected_count else ""
        observed = f", observed {self.observed}" if self.observed is not None else ""
        note = f" — {self.note}" if self.note else ""
        return f"{self.expectation}{where}{count}{observed}{note}"


@dataclass
class ValidationReport:
    """The outcome of one dataset's suite: success flag, per-expectation results, statistics."""

    name: str
    kind: str
    rows: int
    success: bool
    results: list[ExpectationOutcome]
    statistics: dict[str, Any] = field(default_factory=dict)

    @property
    def failures(self) -> list[ExpectationOutcome]:
        return [r for r in self.results if r.status == "failed"]

    @property
    def warnings(self) -> list[ExpectationOutcome]:
        return [r for r in self.results if r.status == "warning"]

    @property
    def passed(self) -> int:
        return sum(r.status == "passed" for r in self.results)

    def status_line(self) -> str:
        skipped = sum(r.status == "skipped" for r in self.results)
        return (f"{self.name} [{self.kind}]: {self.rows} rows, {self.passed}/{len(self.results)} "
                "expectations passed"
                + (f", {len(self.warnings)} warning(s)" if self.warnings else "")
                + (f", {skipped} skipped (missing columns)" if skipped else "")
                + (" — PASS" if self.success else " — FAIL"))

    def summary(self, max_rows: int = 3) -> str:
        """A short text: the status line, then each failed or warned expectation with a few rows."""
        lines = [self.status_line()]
        for outcome in self.failures + self.warnings:
            tag = "FAILED" if outcome.status == "failed" else "WARNING"
            lines.append(f"  {tag} {outcome.describe()}")
            lines += [f"    row {o.row} id={o.id}: {o.value}" for o in outcome.offending[:max_rows]]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed, "total": len(self.results)}


def _plain(value: Any) -> Any:
    """numpy scalars as Python values, so `(2, 1)` does not print as `(np.int64(2), np.int64(1))`."""
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value.item() if hasattr(value, "item") and not isinstance(value, (str, bytes)) else value


def _cut(value: Any, limit: int) -> str:
    value = _plain(value)
    text = "null" if value is None or (not isinstance(value, (list, tuple, dict)) and pd.isna(value)) else \
        str(value) or '""'
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _columns_of(expectation) -> list[str]:
    """Columns an Expectation (or its configuration) reads."""
    kwargs = expectation.kwargs if hasattr(expectation, "kwargs") else vars(expectation)
    return [kwargs[key] for key in ("column", "column_A", "column_B") if kwargs.get(key)]


def _bounds_of(expectation) -> dict[str, Any]:
    """What an Expectation asks of its column: bounds (GX stores them as floats), set, regex, type."""
    kwargs = expectation.kwargs if hasattr(expectation, "kwargs") else vars(expectation)
    return {key: int(value) if isinstance(value, float) and value.is_integer() else value
            for key in ("min_value", "max_value", "value_set", "regex", "type_")
            if (value := kwargs.get(key)) is not None}


def _outcome(result, frame: pd.DataFrame, config: ValidationConfig) -> ExpectationOutcome:
    expectation = result.expectation_config
    severity = str(getattr(expectation.severity, "value", expectation.severity))
    details = result.result or {}
    errors = [info.get("exception_message") for info in _exception_infos(result.exception_info)]
    if errors:
        status, note = "failed", f"could not be evaluated: {errors[0]}"
    elif not result.success and expectation.type == "expect_column_to_exist":
        status, note = "failed", "column missing from the file"
    else:
        status, note = ("passed" if result.success else "failed" if severity == "critical" else "warning"), ""
    ids = frame.get("id")
    offending = []
    for index, value in zip(details.get("partial_unexpected_index_list") or [],
                            details.get("partial_unexpected_list") or [], strict=False):
        row_id = _cut(ids.iloc[index], config.max_value_chars) if ids is not None else "null"
        offending.append(OffendingRow(int(index) + 1, None if row_id == "null" else row_id,
                                      _cut(value, config.max_value_chars)))
    observed = details.get("observed_value")
    return ExpectationOutcome(
        expectation=expectation.type, columns=_columns_of(expectation), status=status,
        bounds=_bounds_of(expectation), severity=severity,
        unexpected_count=(None if details.get("unexpected_count") is None
                          else int(details["unexpected_count"])),
        observed=None if observed is None else _cut(observed, config.max_value_chars),
        offending=offending[: config.max_offending_rows], note=note)


def _exception_infos(info: Any) -> list[dict]:
    """GX gives one exception dict, or a dict of them keyed by metric; keep those that raised."""
    infos = [info] if not info or "raised_exception" in info else list(info.values())
    return [i for i in infos if isinstance(i, dict) and i.get("raised_exception")]


def dataset_statistics(frame: pd.DataFrame) -> dict[str, Any]:
    """Descriptive numbers of a (derived) dataset: lengths, duplicates, format rate, value counts."""
    stats: dict[str, Any] = {"rows": len(frame), "columns": sorted(c for c in frame if c not in DERIVED_FROM)}
    for column in ("question", "completion"):
        if column in frame:
            lengths = frame[column].map(lambda v: len(v) if isinstance(v, str) else None).dropna()
            if len(lengths):
                stats[f"{column}_chars"] = {"min": int(lengths.min()),
                                            "mean": round(float(lengths.mean()), 1),
                                            "max": int(lengths.max())}
    if "completion_tokens" in frame:
        tokens = pd.to_numeric(frame["completion_tokens"], errors="coerce").dropna()
        if len(tokens):
            stats["completion_tokens"] = {"min": int(tokens.min()), "mean": round(float(tokens.mean()), 1),
                                          "max": int(tokens.max())}
    if QUESTION_KEY in frame:
        stats["duplicate_questions"] = int(frame[QUESTION_KEY].dropna().duplicated().sum())
    if FORMAT_CHECK in frame:  # informational for raw teacher outputs (Table 1), required for SFT
        checks = [check if isinstance(check, str) else "no_completion" for check in frame[FORMAT_CHECK]]
        reasons = Counter(check.split(":")[0] for check in checks if check != FORMAT_OK)
        valid = len(checks) - sum(reasons.values())
        stats["format"] = {"valid": valid, "valid_pct": round(100.0 * valid / len(checks), 2),
                           "reasons": dict(sorted(reasons.items()))}
        balanced = pd.Series(True, index=frame.index)
        for opening, closing in TAG_PAIRS:
            balanced &= (frame[TAG_COUNTS[opening]] == frame[TAG_COUNTS[closing]]).fillna(False)
        stats["tag_balanced_pct"] = round(100.0 * float(balanced.mean()), 2)
    for column in ("answer_kind", "dataset", "source", "model", "truncated"):
        if column in frame:
            counts = frame[column].map(lambda v: _cut(v, 80)).value_counts()
            stats[f"{column}_counts"] = {str(k): int(v) for k, v in counts.head(10).items()}
    return stats


def validate_dataset(rows_or_df: Iterable[dict] | pd.DataFrame, kind: Kind, name: str,
                     config: ValidationConfig | None = None) -> ValidationReport:
    """Run the suite of `kind` on a dataset (rows or a DataFrame) and report what broke where."""
    config = config or ValidationConfig()
    frame = rows_or_df if isinstance(rows_or_df, pd.DataFrame) else pd.DataFrame(list(rows_or_df))
    frame = derive_columns(frame.reset_index(drop=True))
    suite = build_suite(kind, config)
    if frame.empty:
        empty = ExpectationOutcome("expect_table_row_count_to_be_between", [], "failed",
                                   unexpected_count=None,
                                   observed="0", note="empty dataset: no rows to train or evaluate on")
        return ValidationReport(name, kind, 0, False, [empty], {"rows": 0})
    runnable, skipped = [], []
    for expectation in suite.expectations:
        missing = [column for column in _columns_of(expectation) if column not in frame]
        if missing and expectation.expectation_type != "expect_column_to_exist":
            sources = ", ".join(sorted({DERIVED_FROM.get(column, column) for column in missing}))
            skipped.append(ExpectationOutcome(expectation.expectation_type, missing, "skipped",
                                              _bounds_of(expectation),
                                              note=f"needs missing column(s) {sources}"))
        else:
            runnable.append(expectation)
    gx = _gx()
    run_suite = gx.ExpectationSuite(name=suite.name, expectations=runnable)
    assert _BATCH_DEFINITION is not None  # made by _gx()
    batch = _BATCH_DEFINITION.get_batch(batch_parameters={"dataframe": frame})
    result = batch.validate(run_suite, result_format={"result_format": "SUMMARY",
                                                      "partial_unexpected_count": config.max_offending_rows})
    ordered = sorted(result.results, key=lambda r: r.expectation_config.meta["order"])
    outcomes = [_outcome(r, frame, config) for r in ordered] + skipped
    success = not any(o.status == "failed" for o in outcomes)
    return ValidationReport(name, kind, len(frame), success, outcomes, dataset_statistics(frame))


# ---------------------------------------------------------------- writing


def summary_markdown(reports: list[ValidationReport]) -> str:
    """`summary.md`: one line per dataset, then the failures with a few offending rows."""
    lines = ["# Data validation", "", "| dataset | kind | rows | expectations passed | status |",
             "|---|---|---:|---:|---|"]
    for report in reports:
        status = "pass" if report.success else "**FAIL**"
        if report.success and report.warnings:
            status = f"pass ({len(report.warnings)} warning(s))"
        lines.append(f"| {report.name} | {report.kind} | {report.rows} | "
                     f"{report.passed}/{len(report.results)} | {status} |")
    flagged = [r for r in reports if r.failures or r.warnings]
    if flagged:
        lines += ["", "## Failures and warnings", ""]
        for report in flagged:
            lines += ["```", report.summary(), "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_reports(reports: list[ValidationReport], directory: str | os.PathLike) -> None:
    """Replace `directory` atomically with `<name>.json` per dataset and `summary.md`."""
    with atomic_path(directory, is_dir=True) as tmp:
        for report in reports:
            (Path(tmp) / f"{report.name}.json").write_text(
                json.dumps(report.to_dict(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        (Path(tmp) / "summary.md").write_text(summary_markdown(reports), encoding="utf-8")
