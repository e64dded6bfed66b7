"""Zero-shot teacher generation (stage 1): prompts in, teacher-output records out.

The teacher (DeepSeek-R1-0528-Qwen3-8B in the paper) thinks inside `<think>…</think>`
before answering; the paper keeps only the final, non-thinking output. A response whose
thinking never closes has no final output: it is kept as an empty, truncated completion
so Table 1 counts it (as invalid) instead of silently dropping it.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def strip_thinking(text: str) -> tuple[str, bool]:
    """(final output, thinking_unfinished): the text after the last `</think>`."""
    if THINK_CLOSE in text:
        return text.rsplit(THINK_CLOSE, 1)[1].strip(), False
    if THINK_OPEN in text:
        return "", True
    return text.strip(), False


def teacher_record(problem: dict, prompt: str, completion: str, source: str, model: str,
                   completion_tokens: int, truncated: bool) -> dict:
    """One row of `data/teacher/<dataset>.jsonl` (schema: the problem fields plus these)."""
    return {
        "id": problem["id"],
        "question": problem["question"],
        "ground_truth": problem["ground_truth"],
        "answer_kind": problem["answer_kind"],
        "dataset": problem["dataset"],
        "prompt": prompt,
        "completion": completion,
        "source": source,
        "model": model,
        "completion_tokens": int(completion_tokens),
        "truncated": bool(truncated),
    }
