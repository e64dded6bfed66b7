"""The format filter (stage 2): Algorithm 1 plus the official SFT-data extras.

Algorithm 1 alone gives Table 1's valid rate. The official Parallel-GSM8K additionally
keeps only outputs whose `Final Answer:` is numeric and that fit the SFT length cap;
both extras are params and counted separately, so Table 1 stays Algorithm 1 only. Kept
completions are written in the rollout engine's tag layout (`format.rollout_layout`) unless
`rollout_layout` is off, so SFT trains on the token sequence the RL rollouts fork into.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parallel_r1.config import check_fields
from parallel_r1.format import FormatStats, check_format, rollout_layout
from parallel_r1.rewards import extract_final_answer, gsm8k_number, strip_tags


@dataclass(frozen=True)
class FilterConfig:
    """Options of the filter stage (params.yaml `filter`)."""

    sft_dataset: str = "gsm8k"
    require_numeric_answer: bool = True
    max_tokens: int | None = field(default=4096, metadata={"min": 1})
    rollout_layout: bool = True

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass
class FilterResult:
    """Rows kept for SFT and the counts behind the metrics file."""

    kept: list[dict]
    stats: FormatStats
    dropped_no_numeric_answer: int = 0
    dropped_token_cap: int = 0

    def drop_reasons(self) -> str:
        """Why rows were not kept, every cause with its count, most first: Algorithm 1's rejection
        reasons and the two extras (a row Algorithm 1 rejects is counted under its reason only)."""
        counts = {**self.stats.reasons, "no_numeric_answer (filter.require_numeric_answer)":
                  self.dropped_no_numeric_answer, "over filter.max_tokens": self.dropped_token_cap}
        ranked = sorted(((count, reason) for reason, count in counts.items() if count), key=lambda c: -c[0])
        return ", ".join(f"{reason}: {count}" for count, reason in ranked) or "none"

    def metrics(self, dataset: str, source: str, model: str) -> dict:
        return {
            "dataset": dataset,
            "source": source,
            "model": model,
            "examples": self.stats.examples,
            "valid": self.stats.valid,
            "valid_pct": round(self.stats.valid_pct, 2),
            "reasons": dict(sorted(self.stats.reasons.items())),
            "kept": len(self.kept),
            "dropped_no_numeric_answer": self.dropped_no_numeric_answer,
            "dropped_token_cap": self.dropped_token_cap,
        }


def has_numeric_answer(completion: str) -> bool:
    """Whether the last `Final Answer:` line holds a number."""
    answer = extract_final_answer(strip_tags(completion))
    return answer is not None and gsm8k_number(answer) is not None


def filter_outputs(rows: list[dict], config: FilterConfig) -> FilterResult:
    """Algorithm 1 on every row; the valid rows that also pass the extras are kept (the cap reads the
    teacher's `completion_tokens`, counted before the layout drops the newlines between tags)."""
    result = FilterResult(kept=[], stats=FormatStats())
    for row in rows:
        verdict = check_format(row["completion"])
        result.stats.add(verdict)
        if not verdict.ok:
            continue
        if config.require_numeric_answer and not has_numeric_answer(row["completion"]):
            result.dropped_no_numeric_answer += 1
        elif config.max_tokens is not None and row["completion_tokens"] > config.max_tokens:
            result.dropped_token_cap += 1
        elif config.rollout_layout:
            result.kept.append({**row, "completion": rollout_layout(row["completion"])})
        else:
            result.kept.append(row)
    return result
