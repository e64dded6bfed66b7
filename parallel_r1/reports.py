"""The paper's tables and figures, rebuilt from our metric files with the paper's numbers beside them.

Every markdown report states the profile, the model behind each row and the sample counts,
and shows ours, the paper's value and the difference (Δ = ours − paper, in percentage
points, computed from the rounded numbers shown so the table checks by eye). Reports built
on any profile but "paper" carry a banner saying the numbers are not comparable to the
paper's. The paper's numbers come from the package copy of `paper_results.yaml`; nothing
here is hard-coded to look like them.

Inputs are plain mappings (the stage reads the files), so each report needs only its own
metric files: `metrics/filter/<dataset>.json` (Table 1), `metrics/eval/<model>/<benchmark>.json`
(Table 2 and the ablations), `metrics/rl/<run>/steps.json` (Figure 3),
`metrics/curves/scaffold.json` (Figure 4).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

import yaml

from parallel_r1.config import check_fields
from parallel_r1.errors import PipelineError
from parallel_r1.io import atomic_path

BENCHMARKS = ("aime25", "aime24", "amc23", "math")
# Evaluated beside the paper's benchmarks when present (ours only, no paper number): GSM8K test, and the
# held-out generated word problems (parallel_r1/arithmetic.py), where the small profile's 135M model is right
# some of the time, so where its RL can show an effect on accuracy.
EXTRA_BENCHMARKS = ("gsm8k", "arithmetic")
# Paper column -> (benchmark, metric-file key). Parallel ratio and Avg. are derived.
COLUMN_SOURCES = {
    "aime25_mean16": ("aime25", "mean_at_k"), "aime25_pass16": ("aime25", "pass_at_k"),
    "aime24_mean16": ("aime24", "mean_at_k"), "aime24_pass16": ("aime24", "pass_at_k"),
    "amc23_mean16": ("amc23", "mean_at_k"), "amc23_pass16": ("amc23", "pass_at_k"),
    "math_mean1": ("math", "mean_at_k"),
}
AVG_COLUMNS = ("aime25_mean16", "aime24_mean16", "amc23_mean16", "math_mean1")  # paper: `avg_is`
_BENCH_NAMES = {"aime25": "AIME25", "aime24": "AIME24", "amc23": "AMC23", "math": "MATH", "gsm8k": "GSM8K",
                "arithmetic": "Arithmetic (held out)"}
_REQUIRED_EVAL_KEYS = ("profile", "k", "n_problems", "n_samples", "mean_at_k", "pass_at_k", "parallel_ratio")

ROW_LABELS = {
    "qwen3_4b_base": "Qwen3-4B-Base", "parallel_sft_seen": "Parallel-SFT-Seen",
    "parallel_sft_unseen": "Parallel-SFT-Unseen", "grpo_dapo": "GRPO (DAPO)",
    "grpo_gsm8k_then_dapo": "GRPO (GSM8K → DAPO)", "parallel_r1_seen": "Parallel-R1-Seen",
    "parallel_r1_unseen_s1": "Parallel-R1-Unseen (S1)", "parallel_r1_unseen_s2": "Parallel-R1-Unseen (S2)",
    "parallel_r1_seen_without_gsm8k_rl": "Parallel-R1-Seen w/o GSM8K RL",
    "parallel_r1_unseen_s1_with_gsm8k_rl": "Parallel-R1-Unseen (S1) with GSM8K RL",
    "with_prompt": "Seen, with the Parallel Thinking prompt",
    "without_prompt": "Seen, without the Parallel Thinking prompt",
    "accuracy_only": "Unseen, accuracy-only reward (S1)", "parallel_only": "Unseen, parallel-only reward",
    "alternating": "Unseen, alternating reward (S2)",
    "parallel_diversity": "Unseen, accuracy + parallel − 0.3 × self-BLEU (beyond the paper's tables)",
}
# Rows a report may hold beyond the paper's: no paper number ("—"). parallel_diversity is the reward of the
# authors' released code (`math_dapo_accuracy_add_parallel_add_diversity.py`) that the paper does not report.
BEYOND_PAPER_ROWS = ("parallel_diversity",)
# Reward schedules that pay nothing above -1 without a correct answer (rewards.py): on a model that answers
# ~nothing correctly every rollout gets the same reward, so GRPO has no gradient.
NEEDS_A_CORRECT_ANSWER = ("accuracy", "parallel_times_accuracy", "tiered", "alternating", "scaffold")

PROFILE_NOTES = {
    "small": "SmolLM2-135M-Instruct on a CPU, minutes of SFT and of RL. What it shows: the model learns "
             "the parallel format in SFT (parallel ratio, block position, path diversity); RL trains on "
             "generated one-step additions of single-digit numbers in words (2-5 for the GSM8K stage, "
             "2-9 for the DAPO stage: data.arithmetic), which this model solves "
             "some of the time, so the accuracy rewards get a spread and the paper's comparisons (GRPO "
             "baseline, S1 accuracy, S2 alternating and the diversity reward) train eight updates on 64 "
             "rollouts each; reports/heldout.md compares each with its init on 64 held-out problems "
             "(paired bootstrap; GRPO's init, base, sampled with GRPO's Baseline prompt) and "
             "reports/reward_schedules.md puts their curves side by side (docs/rl_small_profile.md). "
             "What it cannot show: the paper's accuracies -- a 135M model scores ~0 on AIME/AMC/MATH "
             "and GSM8K (one problem each, four of GSM8K: honest zeros),"
             " and the other RL runs (Seen, the training-stage, prompt and parallel-only ablations, "
             "scaffold) run 1-2 steps as mechanics checks and are not evaluated (nor is SFT-Seen), all "
             "that a one-hour run on two cores affords",
    "tiny": "a random-init tiny model; accuracies are not comparable to the paper, "
            "every cell is computed by the real pipeline",
    "paper": "the paper's settings; numbers are comparable to the paper's",
}


@dataclass(frozen=True)
class ReportOptions:
    """Which files feed which report (params.yaml `reports`, every key optional).

    table1_datasets: datasets of Table 1 (`metrics/filter/<dataset>.json`).
    table2_rows / ablation_*_rows: paper row key -> model name (`metrics/eval/<model>/`).
    figure3_runs: RL runs plotted in Figure 3 (`metrics/rl/<run>/steps.json`).
    reward_schedule_runs: RL runs compared in reports/reward_schedules.md (`metrics/rl/<run>/`).
    base_model_label: the profile's base model by name, for the rows whose paper name is the paper's base
        model (on the small profile Table 2's "Qwen3-4B-Base" row is SmolLM2's).
    heldout_runs / heldout_benchmark: RL runs whose final model reports/heldout.md compares with their init
        model on that benchmark's evaluation samples (`data/samples/<model>/<benchmark>.jsonl`).
    """

    table1_datasets: list[str] = field(default_factory=lambda: ["gsm8k", "dapo"])
    base_model_label: str = "Qwen3-4B-Base"
    table2_rows: dict[str, str] = field(default_factory=lambda: {
        "qwen3_4b_base": "base", "parallel_sft_seen": "sft_seen", "parallel_sft_unseen": "sft_unseen",
        "grpo_dapo": "grpo_dapo", "grpo_gsm8k_then_dapo": "grpo_gsm8k_then_dapo",
        "parallel_r1_seen": "parallel_r1_seen", "parallel_r1_unseen_s1": "parallel_r1_unseen_s1",
        "parallel_r1_unseen_s2": "parallel_r1_unseen_s2"})
    ablation_training_rows: dict[str, str] = field(default_factory=lambda: {
        key: key for key in ("parallel_r1_seen", "parallel_r1_seen_without_gsm8k_rl",
                             "parallel_r1_unseen_s1", "parallel_r1_unseen_s1_with_gsm8k_rl")})
    ablation_prompt_rows: dict[str, str] = field(default_factory=lambda: {
        "with_prompt": "parallel_r1_seen", "without_prompt": "parallel_r1_seen_without_prompt"})
    ablation_reward_rows: dict[str, str] = field(default_factory=lambda: {
        "accuracy_only": "parallel_r1_unseen_s1", "parallel_only": "parallel_r1_unseen_parallel_only",
        "parallel_diversity": "parallel_r1_unseen_parallel_diversity",
        "alternating": "parallel_r1_unseen_s2"})
    figure3_runs: list[str] = field(default_factory=lambda: ["parallel_r1_seen", "parallel_r1_unseen_s1",
                                                             "parallel_r1_unseen_s2"])
    heldout_runs: list[str] = field(default_factory=lambda: [
        "parallel_r1_unseen_parallel_only", "parallel_r1_unseen_parallel_diversity"])
    heldout_benchmark: str = "gsm8k"
    reward_schedule_runs: list[str] = field(default_factory=lambda: [
        "parallel_r1_unseen_s1", "parallel_r1_unseen_parallel_only", "parallel_r1_unseen_parallel_diversity",
        "parallel_r1_unseen_s2", "scaffold"])

    def __post_init__(self) -> None:
        check_fields(self)


@functools.cache
def paper_results() -> dict[str, Any]:
    """The paper's numbers (package copy of paper_results.yaml)."""
    text = resources.files("parallel_r1").joinpath("paper_results.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def eval_metrics_path(model: str, benchmark: str, root: str | Path = "metrics/eval") -> Path:
    return Path(root) / model / f"{benchmark}.json"


def banner(profile: str) -> str:
    """The report's first line: the profile and whether its numbers compare with the paper's."""
    note = PROFILE_NOTES.get(profile, "not the paper's settings; numbers are not directly comparable")
    return f"> **profile: {profile}** — {note}."


def write_markdown(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


# ---------------------------------------------------------------- numbers and cells


def _temperature(value: float | None) -> str:
    return "`evaluate.temperature` (params.yaml)" if value is None else f"{value:g}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def delta(ours: float | None, paper: float | None) -> str:
    """Δ = ours (rounded as shown) − paper, signed, one decimal; "—" when either is missing."""
    if ours is None or paper is None:
        return "—"
    diff = round(round(ours, 1) - paper, 1)
    return f"{diff:+.1f}" if diff != 0 else "0.0"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(["---"] * len(headers)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


# ---------------------------------------------------------------- evaluation metrics per model


def _benchmark_metrics(eval_metrics: Mapping[str, Mapping[str, dict]], model: str, benchmark: str,
                       profile: str, report: str) -> dict:
    name = eval_metrics_path(model, benchmark)
    metrics = eval_metrics.get(model, {}).get(benchmark)
    if metrics is None:
        raise PipelineError(f"{name}: missing (needed by {report} for model {model!r})")
    if missing := [key for key in _REQUIRED_EVAL_KEYS if key not in metrics]:
        raise PipelineError(f"{name}: missing key(s) {', '.join(missing)}")
    if metrics["profile"] != profile:
        raise PipelineError(f"{name}: computed for profile {metrics['profile']!r}, the report is for "
                            f"{profile!r}")
    return metrics


def model_scores(eval_metrics: Mapping[str, Mapping[str, dict]], model: str, profile: str,
                 report: str = "the report") -> dict[str, float | None]:
    """A model's paper columns in percent, plus sample diagnostics (ours only).

    Avg. = mean of AVG_COLUMNS (the paper's `avg_is`). Parallel ratio, position and path diversity
    are over all the model's samples: the four benchmarks, and GSM8K when it was evaluated.
    """
    per_bench = {b: _benchmark_metrics(eval_metrics, model, b, profile, report) for b in BENCHMARKS}
    paper_columns = {col: 100.0 * per_bench[bench][key] for col, (bench, key) in COLUMN_SOURCES.items()}
    scores: dict[str, float | None] = dict(paper_columns)
    scores["avg"] = sum(paper_columns[col] for col in AVG_COLUMNS) / len(AVG_COLUMNS)
    for bench in EXTRA_BENCHMARKS:
        if bench in eval_metrics.get(model, {}):
            per_bench[bench] = _benchmark_metrics(eval_metrics, model, bench, profile, report)
            scores[f"{bench}_mean"] = 100.0 * per_bench[bench]["mean_at_k"]
    n_samples = sum(m["n_samples"] for m in per_bench.values())
    with_block = {b: m["parallel_ratio"] * m["n_samples"] for b, m in per_bench.items()}
    scores["parallel_ratio"] = 100.0 * sum(with_block.values()) / n_samples if n_samples else 0.0
    for key in ("parallel_position", "path_diversity"):
        weighted = [(m[key], with_block[b]) for b, m in per_bench.items() if m.get(key) is not None]
        weight = sum(w for _, w in weighted)
        scores[key] = sum(v * w for v, w in weighted) / weight if weight else None
    scores["n_samples"] = n_samples
    scores["truncated"] = sum(m.get("truncated", 0) for m in per_bench.values())
    tokens = [m["mean_response_tokens"] * m["n_samples"] for m in per_bench.values()
              if "mean_response_tokens" in m]
    every_bench = n_samples and len(tokens) == len(per_bench)
    scores["mean_response_tokens"] = sum(tokens) / n_samples if every_bench else None
    return scores


def _extra_columns(scores: Mapping[str, dict | None]) -> list[str]:
    """`<bench>_mean` columns every evaluated row has (GSM8K when evaluated for all of them)."""
    evaluated = [s for s in scores.values() if s is not None]
    return [f"{b}_mean" for b in EXTRA_BENCHMARKS if evaluated and all(f"{b}_mean" in s for s in evaluated)]


def _row_scores(eval_metrics: Mapping[str, Mapping[str, dict]], rows: Mapping[str, str], profile: str,
                report: str, not_evaluated: Collection[str]) -> dict[str, dict | None]:
    """Each row's `model_scores`; None for a row whose model the profile does not evaluate
    (`not_evaluated`: not in params.yaml evaluate.models), which the table shows as such instead of
    failing on its missing metric files."""
    return {key: None if model in not_evaluated else model_scores(eval_metrics, model, profile, report)
            for key, model in rows.items()}


def _score(scores: Mapping[str, dict | None], key: str, col: str) -> float | None:
    row = scores[key]
    return None if row is None else row[col]


def _not_evaluated_note(rows: Mapping[str, str], not_evaluated: Collection[str]) -> list[str]:
    skipped = [model for model in rows.values() if model in not_evaluated]
    if not skipped:
        return []
    return ["", f"Not evaluated on this profile: {', '.join(f'`models/{m}`' for m in skipped)} -- not in "
                "params.yaml `evaluate.models` (their cells read —). On the small profile these are RL runs "
                "of one or two steps, mechanics checks whose training is in reports/rl_runs.md; their "
                "evaluations would cost the budget the comparisons train with."]


def _ks(eval_metrics: Mapping[str, Mapping[str, dict]], models: Sequence[str]) -> dict[str, set[int]]:
    return {b: {eval_metrics[m][b]["k"] for m in models if b in eval_metrics[m]}
            for b in (*BENCHMARKS, *EXTRA_BENCHMARKS)}


def _column_header(col: str, ks: Mapping[str, set[int]]) -> str:
    if col == "parallel_ratio":
        return "Parallel ratio"
    if col == "avg":
        return "Avg."
    if col.endswith("_mean") and col[:-5] in EXTRA_BENCHMARKS:
        bench = col[:-5]
        k = next(iter(ks[bench])) if len(ks[bench]) == 1 else "k"
        return f"{_BENCH_NAMES[bench]} mean@{k} (ours only)"
    bench, key = COLUMN_SOURCES[col]
    k = next(iter(ks[bench])) if len(ks[bench]) == 1 else "k"
    return f"{_BENCH_NAMES[bench]} {'mean' if key == 'mean_at_k' else 'pass'}@{k}"


def _sample_counts(eval_metrics: Mapping[str, Mapping[str, dict]], models: Sequence[str]) -> str:
    if not models:
        return "Samples per model: none (no row's model is evaluated on this profile)."
    parts = []
    for bench in (*BENCHMARKS, *EXTRA_BENCHMARKS):
        if not all(bench in eval_metrics[m] for m in models):
            continue
        counts = sorted({(eval_metrics[m][bench]["k"], eval_metrics[m][bench]["n_problems"]) for m in models})
        text = ", ".join(f"k={k} × {n} problems" for k, n in counts)
        differs = " (differs between models)" if len(counts) > 1 else ""
        parts.append(f"{_BENCH_NAMES[bench]}: {text}{differs}")
    return "Samples per model: " + "; ".join(parts) + "."


def _check_rows(rows: Mapping[str, str], paper_rows: Mapping[str, Any], report: str,
                beyond: Sequence[str] = ()) -> None:
    unknown = [key for key in rows if key not in paper_rows and key not in beyond]
    if unknown:
        known = ", ".join(paper_rows)
        raise PipelineError(f"{report} rows: unknown row {unknown[0]!r} (paper rows: {known})")
    missing = [key for key in paper_rows if key not in rows]
    if missing:
        raise PipelineError(f"{report} rows: no model given for paper row {missing[0]!r}")


def _header_lines(title: str, profile: str, notes: Sequence[str]) -> list[str]:
    return [f"# {title}", "", banner(profile), "", *notes, ""]


def _details_table(rows: Mapping[str, str], scores: Mapping[str, dict | None]) -> list[str]:
    body = []
    for key, model in rows.items():
        score = scores[key]
        if score is None:
            body.append([ROW_LABELS.get(key, key), f"`models/{model}`", "not evaluated", "—", "—", "—", "—"])
            continue
        position, diversity = score["parallel_position"], score["path_diversity"]
        body.append([ROW_LABELS.get(key, key), f"`models/{model}`", str(score["n_samples"]),
                     str(score["truncated"]),
                     _pct(score["mean_response_tokens"]), "—" if position is None else f"{position:.2f}",
                     "—" if diversity is None else f"{diversity:.2f}"])
    return _table(["Row", "Model", "Samples", "Truncated", "Mean response tokens",
                   "`<Parallel>` position", "Path diversity"], body)


# ---------------------------------------------------------------- tables


def table1(filter_metrics: Mapping[str, dict], profile: str) -> str:
    """Table 1: share of teacher outputs passing Algorithm 1, per dataset, beside the paper's."""
    paper = paper_results()["table1_data_pipeline"]
    body, kept = [], []
    for dataset, metrics in filter_metrics.items():
        where = f"metrics/filter/{dataset}.json"
        if missing := [k for k in ("source", "model", "examples", "valid", "valid_pct",
                                   "reasons") if k not in metrics]:
            raise PipelineError(f"{where}: missing key(s) {', '.join(missing)}")
        source = (f"released generations of {metrics['model']}" if metrics["source"] == "released"
                  else f"model: {metrics['model']}")
        ref = paper.get(dataset, {})
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(metrics["reasons"].items(), key=lambda kv: -kv[1]))
        body.append([dataset, source, f"{metrics['examples']} ({ref.get('examples', '—')})",
                     str(metrics["valid"]),
                     _pct(metrics["valid_pct"]), _pct(ref.get("valid_pct")),
                     delta(metrics["valid_pct"], ref.get("valid_pct")), reasons or "—"])
        if "kept" in metrics:
            kept.append([dataset, str(metrics["kept"]), str(metrics.get("dropped_no_numeric_answer", "—")),
                         str(metrics.get("dropped_token_cap", "—"))])
    lines = _header_lines("Table 1 — Parallel-format valid rate of the teacher's outputs", profile, [
        "Valid = passes Algorithm 1 (the Parallel Thinking format check) with at least one block; "
        "it says nothing about correctness. Δ = ours − paper in percentage points. The paper gives "
        "83.7% for GSM8K in its table and 83.6% in its Key Finding 1 box; the table's value is used.",
    ])
    lines += _table(["Dataset", "Source", "Examples (paper)", "Valid", "Valid % (ours)", "Valid % (paper)",
                     "Δ", "Rejections (reason: count)"], body)
    if kept:
        lines += ["",
                  "## SFT set kept from the valid outputs (numeric `Final Answer:` and within the token cap)",
                  ""]
        lines += _table(["Dataset", "Kept", "Dropped: no numeric answer", "Dropped: over token cap"], kept)
    return "\n".join(lines) + "\n"


def table2(eval_metrics: Mapping[str, Mapping[str, dict]], rows: Mapping[str, str], profile: str,
           base_model_label: str = "Qwen3-4B-Base", not_evaluated: Collection[str] = (),
           temperature: float | None = None) -> str:
    """Table 2: the eight main rows; cells "ours (paper)" and a Δ table below.

    "Row (paper)" is the paper's row; "Ours" names the model that fills it on this profile: the base
    model by `base_model_label`, every other row by its folder (trained from that base model). Rows whose
    model is in `not_evaluated` read "—". `temperature`: the evaluations' (params.yaml
    evaluate.temperature)."""
    paper = paper_results()["table2_main"]
    columns, paper_rows = paper["columns"], paper["rows"]
    _check_rows(rows, paper_rows, "table2")
    scores = _row_scores(eval_metrics, rows, profile, "table2", not_evaluated)
    evaluated = [model for model in rows.values() if model not in not_evaluated]
    ks = _ks(eval_metrics, evaluated)
    extra = _extra_columns(scores)
    headers = ["Row (paper)", "Ours"] + [_column_header(c, ks) for c in columns]
    ours_rows, delta_rows = [], []
    for key, model in rows.items():
        ref = dict(zip(columns, paper_rows[key], strict=True))
        ours = f"{base_model_label} (`models/{model}`)" if model == "base" else f"`models/{model}`"
        label = [ROW_LABELS.get(key, key), ours]
        ours_rows.append(label + [f"{_pct(_score(scores, key, c))} ({_pct(ref[c])})" for c in columns]
                         + [_pct(_score(scores, key, c)) for c in extra])
        delta_rows.append(label + [delta(_score(scores, key, c), ref[c]) for c in columns])
    lines = _header_lines("Table 2 — Main results", profile, [
        "Percentages. Cells: **ours (paper)**. mean@k = accuracy averaged over k samples per problem, "
        f"pass@k = unbiased estimator; sampled at temperature {_temperature(temperature)}; the paper's cells "
        "are mean@16 / pass@16 at temperature 1.0 and MATH "
        "mean@1. "
        "Parallel ratio = share of a model's samples with at least one well-formed `<Parallel>` block, over "
        "all benchmarks evaluated (the paper's four, plus GSM8K test where it has a column). Path diversity "
        "= 1 − mean pairwise word-level similarity of a block's paths (beyond the paper; 0 = copies). "
        "Avg. = mean of AIME25 mean, AIME24 mean, AMC23 mean and MATH mean@1 (the paper's definition; "
        "its text gives 4.6 for the base model, its table 6.6, which matches its cells).",
        "", _sample_counts(eval_metrics, evaluated), *_not_evaluated_note(rows, not_evaluated),
    ])
    lines += _table(headers + [_column_header(c, ks) for c in extra], ours_rows)
    lines += ["", "## Δ = ours − paper (percentage points)", ""] + _table(headers, delta_rows)
    lines += ["", "## Sample details (ours)", ""] + _details_table(rows, scores)
    return "\n".join(lines) + "\n"


def _ablation(title: str, paper_rows: Mapping[str, Mapping[str, float]],
              eval_metrics: Mapping[str, Mapping[str, dict]],
              rows: Mapping[str, str], profile: str, report: str, note: str = "",
              beyond: Sequence[str] = (), not_evaluated: Collection[str] = ()) -> str:
    """An ablation table: for each paper column, ours | paper | Δ side by side; rows in `beyond` have no
    paper number, rows whose model is in `not_evaluated` read "—"."""
    _check_rows(rows, paper_rows, report, beyond)
    columns = list(dict.fromkeys(c for ref in paper_rows.values() for c in ref))
    scores = _row_scores(eval_metrics, rows, profile, report, not_evaluated)
    evaluated = [model for model in rows.values() if model not in not_evaluated]
    ks = _ks(eval_metrics, evaluated)
    headers = ["Row", "Model"]
    for col in columns:
        headers += [f"{_column_header(col, ks)} (ours)", f"{_column_header(col, ks)} (paper)", "Δ"]
    body = []
    for key, model in rows.items():
        cells = [ROW_LABELS.get(key, key), f"`models/{model}`"]
        for col in columns:
            ours, ref = _score(scores, key, col), paper_rows.get(key, {}).get(col)
            cells += [_pct(ours), _pct(ref), delta(ours, ref)]
        body.append(cells)
    lines = _header_lines(title, profile, [
        "Percentages. Δ = ours − paper in percentage points. Avg. = mean of AIME25, AIME24, AMC23 "
        "mean@k and MATH mean@1; parallel ratio over the samples of all four benchmarks." + note,
        "", _sample_counts(eval_metrics, evaluated), *_not_evaluated_note(rows, not_evaluated),
    ])
    lines += _table(headers, body) + ["", "## Sample details (ours)", ""] + _details_table(rows, scores)
    return "\n".join(lines) + "\n"


def ablation_training(eval_metrics: Mapping[str, Mapping[str, dict]], rows: Mapping[str, str] | None = None,
                      *, profile: str, not_evaluated: Collection[str] = ()) -> str:
    """Table 3: average accuracy with and without the GSM8K RL stage, Seen and Unseen."""
    ref = {key: {"avg": value} for key, value in paper_results()["table3_training_ablation_avg"].items()}
    return _ablation("Table 3 — Training-stage ablation", ref, eval_metrics,
                     rows or ReportOptions().ablation_training_rows, profile, "ablation_training",
                     not_evaluated=not_evaluated)


def ablation_prompt(eval_metrics: Mapping[str, Mapping[str, dict]], rows: Mapping[str, str] | None = None,
                    *, profile: str, not_evaluated: Collection[str] = ()) -> str:
    """Parallel-R1-Seen trained and evaluated with and without the Parallel Thinking prompt."""
    return _ablation("Prompt ablation — Parallel-R1-Seen with and without the Parallel Thinking prompt",
                     paper_results()["prompt_ablation"], eval_metrics,
                     rows or ReportOptions().ablation_prompt_rows, profile, "ablation_prompt",
                     not_evaluated=not_evaluated)


def ablation_reward(eval_metrics: Mapping[str, Mapping[str, dict]], rows: Mapping[str, str] | None = None,
                    *, profile: str, not_evaluated: Collection[str] = ()) -> str:
    """Reward modelling for Parallel-R1-Unseen: accuracy-only, parallel-only, alternating."""
    return _ablation("Reward ablation — Parallel-R1-Unseen", paper_results()["reward_ablation_unseen"],
                     eval_metrics, rows or ReportOptions().ablation_reward_rows, profile, "ablation_reward",
                     note=" The paper reports no AMC23 number for the alternating reward. The row "
                          "'accuracy + parallel − 0.3 × self-BLEU' is beyond the paper's tables: the reward "
                          "of the authors' released code "
                          "(`math_dapo_accuracy_add_parallel_add_diversity.py`), "
                          "with no paper number.", beyond=BEYOND_PAPER_ROWS, not_evaluated=not_evaluated)


def rl_runs(summaries: Mapping[str, Mapping[str, Any]], steps: Mapping[str, Sequence[Mapping[str, Any]]],
            profile: str) -> str:
    """Every RL run in one table: did GRPO get a gradient, and what moved.

    GRPO's advantage is a reward minus its group's mean: a step where every prompt's rollouts got
    the same reward has zero advantages everywhere and changes no weight. "Steps with a gradient"
    counts the steps where TRL's `frac_reward_zero_std` < 1 (some group had a reward spread).
    """
    body = []
    for run, summary in summaries.items():
        where = f"metrics/rl/{run}/summary.json"
        if missing := [k for k in ("reward", "variant", "steps",
                                   "steps_with_reward_spread") if k not in summary]:
            raise PipelineError(f"{where}: missing key(s) {', '.join(missing)}")
        history = steps.get(run, [])
        first, last = (history[0], history[-1]) if history else ({}, {})

        def moved(key: str, first: Mapping[str, Any] = first, last: Mapping[str, Any] = last) -> str:
            a, b = first.get(key), last.get(key)
            return "—" if a is None or b is None else f"{a:.2f} → {b:.2f}"

        diversity = [h["path_diversity"] for h in history if h.get("path_diversity") is not None]
        gated = "yes" if summary["reward"] in NEEDS_A_CORRECT_ANSWER else "no"
        body.append([f"`{run}`", str(summary["reward"]), gated, str(summary["variant"]),
                     f"{summary['steps_with_reward_spread']} / {summary['steps']}", moved("reward"),
                     moved("parallel_ratio"), moved("accuracy"),
                     f"{sum(diversity) / len(diversity):.2f}" if diversity else "—"])
    lines = _header_lines("RL runs — reward spread, reward and parallel ratio over the steps", profile, [
        "Steps with a gradient = steps where at least one prompt's rollouts got different rewards (TRL's "
        "`frac_reward_zero_std` < 1); only those change a weight. Columns with → show the first and the "
        "last step. Path diversity = 1 − mean pairwise word-level similarity of a block's paths, averaged "
        "over the steps' responses with a block. Speed, resume points and runs reused from the RL memo are "
        "in metrics/runtime/rl/ and the make-run summary, not here: they do not change a run's result. "
        "Needs a correct answer: "
        "the reward pays nothing above its minimum without one, so a group with no correct rollout has no "
        "spread, and on problems the model never solves its steps move no weight.",
    ])
    lines += _table(["Run", "Reward schedule", "Needs a correct answer", "Variant", "Steps with a gradient",
                     "Reward", "Parallel ratio", "Accuracy", "Path diversity"], body)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- figures


def whole_step_axis(axis) -> None:
    """Ticks at whole steps only: an RL step has no halves, and matplotlib's default ticks on a few-step
    run (1, 1.25, 1.5, ...) read as if it had."""
    from matplotlib.ticker import MaxNLocator

    axis.xaxis.set_major_locator(MaxNLocator(integer=True))


def _new_figure(rows: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5 if rows == 1 else 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save_png(fig, path: str | Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)


def _subtitle(profile: str) -> str:
    note = {"tiny": " — tiny random-init model, not comparable to the paper",
            "small": " — SmolLM2-135M on CPU, not comparable to the paper"}.get(profile, "")
    return f"profile: {profile}{note}"


def _check_entries(entries: Any, keys: Sequence[str], where: str) -> None:
    if not isinstance(entries, list) or not entries:
        raise PipelineError(f"{where}: expected a non-empty list of objects")
    for index, entry in enumerate(entries):
        if missing := [key for key in keys if not isinstance(entry, dict) or key not in entry]:
            raise PipelineError(f"{where}: entry {index} lacks {', '.join(missing)}")


def figure3_parallel_position(steps_by_run: Mapping[str, Sequence[dict]], path: str | Path, *,
                              profile: str) -> None:
    """Figure 3: relative position of the first `<Parallel>` over RL steps, one line per run.

    Steps where no response held a block (position null) are gaps in the line, not zeros.
    """
    if not steps_by_run:
        raise PipelineError("figure3: no RL runs to plot")
    fig = _new_figure()
    ax = fig.add_subplot()
    all_steps = [s["step"] for steps in steps_by_run.values() for s in steps if "step" in s]
    for run, steps in steps_by_run.items():
        _check_entries(steps, ("step", "parallel_position"), f"metrics/rl/{run}/steps.json")
        ordered = sorted(steps, key=lambda s: s["step"])
        ys = [math.nan if s["parallel_position"] is None else s["parallel_position"] for s in ordered]
        label = run if any(not math.isnan(y) for y in ys) else f"{run} (no block at any step)"
        ax.plot([s["step"] for s in ordered], ys, marker="o", markersize=3, linewidth=1.5, label=label)
    ax.set_ylim(0, 1)
    if all_steps:  # keep the step axis even when no run has a block (all gaps)
        ax.set_xlim(min(all_steps) - 0.5, max(all_steps) + 0.5)
    ax.set_xlabel("RL step")
    whole_step_axis(ax)
    ax.set_ylabel("relative position of first <Parallel>\n(start ÷ response length)")
    ax.set_title(f"Figure 3 — where parallel thinking starts, over RL\n{_subtitle(profile)}", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=9)
    _save_png(fig, path)


def figure4_scaffold(curve: Mapping[str, Any], path: str | Path, paper_peak: float | None = None,
                     *, profile: str) -> None:
    """Figure 4: the scaffold run's AIME25 mean@k (top) and parallel ratio (bottom) over steps.

    A vertical line marks the switch from alternating rewards to accuracy-only GRPO; a
    horizontal line marks the paper's AIME25 mean@16 peak (25.6% unless given).
    """
    where = "metrics/curves/scaffold.json"
    if missing := [key for key in ("switch_step", "k", "points") if key not in curve]:
        raise PipelineError(f"{where}: missing key(s) {', '.join(missing)}")
    _check_entries(curve["points"], ("step", "mean_at_k", "parallel_ratio"), f"{where} points")
    points = sorted(curve["points"], key=lambda p: p["step"])
    peak = paper_results()["scaffold"]["aime25_mean16_peak"] if paper_peak is None else paper_peak
    steps, k = [p["step"] for p in points], curve["k"]
    bench = _BENCH_NAMES.get(curve.get("benchmark", "aime25"), curve.get("benchmark"))
    fig = _new_figure(rows=2)
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(steps, [100 * p["mean_at_k"] for p in points], marker="o", markersize=3,
             label=f"{bench} mean@{k} (ours)")
    top.axhline(peak, color="gray", linestyle="--", label=f"paper's peak {peak:.1f}%")
    top.set_ylabel(f"{bench} mean@{k} (%)")
    top.set_ylim(bottom=0)
    bottom.plot(steps, [100 * p["parallel_ratio"] for p in points], marker="o", markersize=3,
                color="tab:orange", label="parallel ratio (ours)")
    bottom.set_ylabel("parallel ratio (%)")
    bottom.set_ylim(-2, 102)
    bottom.set_xlabel("RL step")
    for ax in (top, bottom):
        whole_step_axis(ax)
        ax.axvline(curve["switch_step"], color="tab:red", linestyle=":",
                   label=f"switch to accuracy-only (step {curve['switch_step']})")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=9)
    top.set_title(f"Figure 4 — parallel thinking as a scaffold\n{_subtitle(profile)}", fontsize=11)
    _save_png(fig, path)
