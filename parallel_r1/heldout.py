"""Held-out check of an RL run: its init model vs its final model on the same held-out questions.

Both models are evaluated by `evaluate@<model>` with the same prompts and the same sampler seeds (a sample's
seed derives from `seed` and its place in the job list, not from the model), so the per-question difference
final − init is a paired comparison: what varies is the weights. An init evaluated with another prompt or
rollout mode than its run samples with (base, with the Parallel Thinking prompt, under the GRPO baseline's
Baseline one) is paired through `evaluate_init@<run>` instead: the init's weights as the run samples, written
as the evaluation `<run>.init` (INIT_SUFFIX); `same_rollout` checks every pair. Per question, a metric is the
mean over its k samples (path diversity and 1 − self-BLEU over the samples that hold a block; a question where
either model has none drops out of that metric's pairs). The interval is the percentile bootstrap over
questions: resample the n paired differences with replacement, take the mean, `resamples` times. An interval
that excludes 0 says the change is beyond the sampling noise of these n questions.

Beyond the paper: the small profile's RL runs are a few updates on a 135M model, where a few steps of a reward
curve are noise; this is the check that its comparisons (`reports.heldout_runs`: GRPO baseline, S1, S2,
diversity) changed what the model writes, on held-out generated problems (parallel_r1/arithmetic.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from parallel_r1.errors import PipelineError
from parallel_r1.format import self_bleu

RESAMPLES = 10_000
LEVEL = 0.95
INIT_SUFFIX = ".init"   # evaluate_init@<run> writes the evaluation <run>.init: its init, as the run samples
ROLLOUT_KEYS = ("prompt", "variant", "parallel_rollout")   # how an evaluation sampled (its metrics say)


def same_rollout(init: Mapping[str, Any], final: Mapping[str, Any], where: tuple[str, str], run: str) -> None:
    """Fail, in one line, unless the two evaluations (their metrics files) sampled with the same prompt and
    rollout mode: otherwise final − init would mix the prompt's effect into the weights'."""
    unrecorded = [path for path, metrics in zip(where, (init, final), strict=True)
                  if any(key not in metrics for key in ROLLOUT_KEYS)]
    if unrecorded:
        raise PipelineError(f"{unrecorded[0]}: no record of the prompt and rollout mode it was sampled with "
                            f"(written before evaluations recorded them): run its evaluation again")
    differ = [key for key in ROLLOUT_KEYS if init.get(key) != final.get(key)]
    if differ:
        shown = ", ".join(f"{key} {init.get(key)!r} vs {final.get(key)!r}" for key in differ)
        raise PipelineError(f"{where[0]} and {where[1]}: the init and final of {run!r} sampled differently "
                            f"({shown}); list {run!r} in params.yaml evaluate.inits to evaluate its init "
                            f"as it samples")


@dataclass(frozen=True)
class PairedInterval:
    """Mean of the paired differences (final − init) and its bootstrap interval over `n` pairs."""

    n: int
    init_mean: float
    final_mean: float
    mean_difference: float
    low: float
    high: float

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def bootstrap_interval(differences: Sequence[float], seed: int, resamples: int = RESAMPLES,
                       level: float = LEVEL) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `differences` (numpy's linear percentiles), seeded."""
    import numpy as np

    if not differences:
        raise PipelineError("bootstrap: no paired differences")
    values = np.asarray(differences, dtype=float)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(values), size=(resamples, len(values)))
    means = values[picks].mean(axis=1)
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def paired(init: Mapping[str, float], final: Mapping[str, float], seed: int,
           resamples: int = RESAMPLES) -> PairedInterval | None:
    """The paired comparison over the questions both mappings (question id -> value) hold; None if none."""
    common = sorted(set(init) & set(final))
    if not common:
        return None
    diffs = [final[q] - init[q] for q in common]
    low, high = bootstrap_interval(diffs, seed, resamples)
    return PairedInterval(len(common), sum(init[q] for q in common) / len(common),
                          sum(final[q] for q in common) / len(common), sum(diffs) / len(diffs), low, high)


def _diversity_by_bleu(row: Mapping[str, Any]) -> float | None:
    """1 − `format.self_bleu` of a sample with a well-formed block (>= 2 paths each), else None."""
    return 1.0 - self_bleu(row["response"]) if row["parallel"] else None


def _diversity_of_any_block(row: Mapping[str, Any]) -> float:
    """1 − `format.self_bleu` of any sample, as the official parallel_diversity reads it
    (`self_bleu_reads: any_block`): every closed `<Parallel>…</Parallel>` span counts, well-formed or not,
    and a sample without one is 0. A run can raise this while its parallel ratio falls (diverse paths in
    blocks that fail the format check)."""
    return 1.0 - self_bleu(row["response"])


# metric -> (label, value of one evaluation row or None when it has none)
METRICS: dict[str, tuple[str, Callable[[Mapping[str, Any]], float | None]]] = {
    "parallel_ratio": ("parallel ratio", lambda row: float(row["parallel"])),
    "path_diversity": ("path diversity (1 − word-level similarity)", lambda row: row.get("path_diversity")),
    "one_minus_self_bleu": ("1 − self-BLEU of the paths (the diversity reward's term)", _diversity_by_bleu),
    "one_minus_self_bleu_any_block": ("1 − self-BLEU of any closed block, well-formed or not (0 without)",
                                      _diversity_of_any_block),
    "accuracy": ("accuracy", lambda row: float(row["correct"])),
}


def per_question(rows: Sequence[Mapping[str, Any]], metric: str, where: str) -> dict[str, float]:
    """question id -> mean of `metric` over its samples that have a value (a question with none: left out)."""
    value_of = METRICS[metric][1]
    values: dict[str, list[float]] = {}
    for index, row in enumerate(rows, start=1):
        missing = [key for key in ("problem_id", "response", "parallel", "correct") if key not in row]
        if missing:
            raise PipelineError(f"{where} row {index}: missing field(s) {', '.join(missing)}")
        value = value_of(row)
        values.setdefault(str(row["problem_id"]), [])
        if value is not None:
            values[str(row["problem_id"])].append(float(value))
    return {q: sum(v) / len(v) for q, v in values.items() if v}


def compare(init_rows: Sequence[Mapping[str, Any]], final_rows: Sequence[Mapping[str, Any]], seed: int,
            where: tuple[str, str], resamples: int = RESAMPLES) -> dict[str, PairedInterval | None]:
    """Every METRICS entry, paired over questions, for one run (its init's and its final model's samples)."""
    init_ids = {str(row.get("problem_id")) for row in init_rows}
    final_ids = {str(row.get("problem_id")) for row in final_rows}
    if init_ids != final_ids:
        raise PipelineError(f"{where[1]}: its questions differ from {where[0]}'s "
                            f"({len(final_ids ^ init_ids)} not in both): evaluate both on the same data/eval")
    return {metric: paired(per_question(init_rows, metric, where[0]),
                           per_question(final_rows, metric, where[1]), seed, resamples) for metric in METRICS}


def as_json(results: Mapping[str, Mapping[str, PairedInterval | None]]) -> dict:
    """metrics/heldout.json: run -> metric -> the interval's fields (null where no pair exists)."""
    return {run: {metric: None if interval is None else {**interval.__dict__,
                                                         "excludes_zero": interval.excludes_zero}
                  for metric, interval in metrics.items()} for run, metrics in results.items()}


def markdown(results: Mapping[str, Mapping[str, PairedInterval | None]], inits: Mapping[str, str],
             benchmark: str, banner: str, resamples: int = RESAMPLES) -> str:
    """reports/heldout.md: one row per (run, metric); `inits` holds each run's Init cell (markdown)."""
    lines = ["# Held-out check — init vs final model of the RL runs that can move", "", banner, "",
             f"Each run's init model and final model on the same held-out `{benchmark}` questions, same "
             "prompts and sampler seeds (`evaluate@<model>`); per question, final − init; the mean of these "
             f"paired differences and its {int(LEVEL * 100)}% percentile bootstrap interval over questions "
             f"({resamples} resamples). Path diversity and 1 − self-BLEU pair only the questions where both "
             "models wrote a well-formed block (n says how many); 1 − self-BLEU of any closed block pairs "
             "every question. An init shown *as `<run>` samples* is evaluated with its run's prompt and "
             "rollout mode (`evaluate_init@<run>`: the GRPO baseline samples with the Baseline prompt). "
             "**Beyond noise** = the interval excludes 0.", "",
             "| Run | Init | Metric | n | Init | Final | Final − init | 95% interval | Beyond noise |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run, metrics in results.items():
        for metric, interval in metrics.items():
            label = METRICS[metric][0]
            if interval is None:
                lines.append(f"| `{run}` | {inits[run]} | {label} | 0 | — | — | — | — | — |")
                continue
            verdict = ("yes, up" if interval.low > 0 else "yes, down") if interval.excludes_zero else "no"
            lines.append(f"| `{run}` | {inits[run]} | {label} | {interval.n} | {interval.init_mean:.3f} | "
                         f"{interval.final_mean:.3f} | {interval.mean_difference:+.3f} | "
                         f"[{_signed(interval.low)}, {_signed(interval.high)}] | {verdict} |")
    return "\n".join(lines) + "\n"


def _signed(value: float) -> str:
    return "0.000" if math.isclose(value, 0.0, abs_tol=5e-4) else f"{value:+.3f}"
