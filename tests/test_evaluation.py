"""pass@k, mean@k and the per-benchmark summary of scored samples."""

from __future__ import annotations

from fractions import Fraction
from math import comb
from types import SimpleNamespace

import pytest

from parallel_r1.errors import PipelineError
from parallel_r1.evaluation import (
    METRIC_KEYS,
    Sample,
    ScoredSample,
    benchmark_jobs,
    by_benchmark,
    generate_jobs,
    mean_at_k,
    pass_at_k,
    sample_from_row,
    sample_to_row,
    score_sample,
    summarize,
)

BLOCK = "<Parallel><Path>a</Path><Path>b</Path></Parallel><Summary>s</Summary>"  # 69 characters


def padded(prefix_chars: int, answer: str) -> str:
    """A 200-character response whose block starts at character `prefix_chars`."""
    tail = f"\nFinal Answer: {answer}"
    text = "x" * prefix_chars + BLOCK + "." * (200 - prefix_chars - len(BLOCK) - len(tail)) + tail
    assert len(text) == 200
    return text


def sample(pid: str, index: int, response: str, truth: str = "4", tokens: int = 10, truncated: bool = False):
    return Sample(pid, index, response, truth, "gsm8k", tokens, truncated)


# ---------------------------------------------------------------- pass@k / mean@k


def test_pass_at_k_known_value_n5_c2_k2():
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10


def test_pass_at_k_with_n_equal_k_is_any_correct():
    assert pass_at_k(16, 1, 16) == 1.0
    assert pass_at_k(16, 0, 16) == 0.0


def test_pass_at_k_all_correct_and_none_correct():
    assert pass_at_k(8, 8, 3) == 1.0
    assert pass_at_k(8, 0, 3) == 0.0


@pytest.mark.parametrize("n,c", [(1, 0), (1, 1), (5, 2), (16, 7), (16, 16)])
def test_pass_at_1_equals_share_correct(n, c):
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_pass_at_k_product_form_matches_binomials_even_for_large_n():
    for n, c, k in [(10, 3, 4), (20, 5, 16), (200, 3, 100), (1000, 2, 500)]:
        exact = 1 - Fraction(comb(n - c, k), comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


def test_pass_at_k_rejects_k_larger_than_n_in_one_line():
    with pytest.raises(PipelineError) as err:
        pass_at_k(3, 1, 5, "aime25 problem 'p1'")
    assert str(err.value) == "k=5 larger than the n=3 samples generated for aime25 problem 'p1'"


def test_mean_at_k_averages_within_then_across_problems():
    assert mean_at_k([[True, False], [True, False, False, False]]) == pytest.approx((0.5 + 0.25) / 2)


# ---------------------------------------------------------------- scoring single samples


def test_score_sample_reads_correctness_block_and_position():
    scored = score_sample(sample("p", 0, padded(20, "4")))
    assert (scored.correct, scored.parallel, scored.blocks) == (True, True, 1)
    assert scored.parallel_position == pytest.approx(0.10)


def test_malformed_block_is_not_parallel_and_has_no_position():
    text = "think <Parallel><Path>only one</Path></Parallel><Summary>s</Summary>\nFinal Answer: 4"
    scored = score_sample(sample("p", 0, text))
    assert scored.correct and not scored.parallel
    assert scored.blocks == 0 and scored.parallel_position is None


def test_sample_to_row_adds_verdict_fields_and_round_trips():
    row = sample_to_row(sample("p", 3, padded(60, "5"), tokens=7, truncated=True))
    assert row["correct"] is False and row["parallel"] is True
    assert row["parallel_position"] == pytest.approx(0.30)
    assert (row["problem_id"], row["sample_index"], row["completion_tokens"],
            row["truncated"]) == ("p", 3, 7, True)
    assert sample_from_row(row) == Sample("p", 3, padded(60, "5"), "4", "gsm8k", 7, True)


def test_sample_from_row_names_missing_fields():
    with pytest.raises(PipelineError, match="gen.jsonl:4: missing field\\(s\\) truncated"):
        sample_from_row({"problem_id": "p", "sample_index": 0, "response": "", "ground_truth": "1",
                         "answer_kind": "gsm8k", "completion_tokens": 3}, "gen.jsonl:4")


# ---------------------------------------------------------------- summarize


def five_samples() -> list[Sample]:
    """p1 (truth 4): 1 of 2 right; p2 (truth 7): 1 of 3 right, one of them truncated."""
    return [
        sample("p1", 0, padded(20, "4"), tokens=10),  # parallel at 0.10, correct
        sample("p1", 1, "plain reasoning\nFinal Answer: 5", tokens=20),
        sample("p2", 0, padded(60, "7"), truth="7", tokens=30),  # parallel at 0.30, correct
        sample("p2", 1, "Final Answer: 8", truth="7", tokens=40),
        sample("p2", 2, "<Parallel><Path>cut off mid-pa", truth="7", tokens=50, truncated=True),
    ]


def test_summarize_matches_hand_computed_metrics():
    metrics = summarize(five_samples(), 2, model="m", benchmark="aime25", profile="tiny")
    assert set(METRIC_KEYS) <= set(metrics)
    assert (metrics["model"], metrics["benchmark"], metrics["profile"]) == ("m", "aime25", "tiny")
    assert (metrics["k"], metrics["n_problems"], metrics["n_samples"]) == (2, 2, 5)
    assert metrics["mean_at_k"] == pytest.approx((1 / 2 + 1 / 3) / 2)
    assert metrics["pass_at_k"] == pytest.approx((1.0 + (1 - 1 / 3)) / 2)  # p2: 1 - C(2,2)/C(3,2)
    assert metrics["parallel_ratio"] == pytest.approx(2 / 5)
    assert metrics["parallel_position"] == pytest.approx(0.20)
    assert metrics["mean_response_tokens"] == pytest.approx(30.0)
    assert metrics["truncated"] == 1 and metrics["truncated_rate"] == pytest.approx(0.2)
    assert metrics["blocks_per_response"] == pytest.approx(2 / 5)


def test_summarize_has_null_position_when_no_sample_has_a_block():
    samples = [sample("p", i, "Final Answer: 4") for i in range(2)]
    metrics = summarize(samples, 2, model="m", benchmark="b", profile="tiny")
    assert metrics["parallel_position"] is None and metrics["parallel_ratio"] == 0.0


def test_truncated_sample_with_a_final_answer_is_scored_not_dropped():
    samples = [sample("p", 0, "Final Answer: 4 and then it ran o", truncated=True)]
    metrics = summarize(samples, 1, model="m", benchmark="b", profile="tiny")
    assert metrics["n_samples"] == 1 and metrics["truncated"] == 1 and metrics["mean_at_k"] == 1.0


def test_summarize_accepts_already_scored_samples():
    scored = [score_sample(s) for s in five_samples()]
    assert all(isinstance(s, ScoredSample) for s in scored)
    assert (summarize(scored, 2, model="m", benchmark="b", profile="tiny")["mean_at_k"]
            == pytest.approx(5 / 12))


def test_summarize_rejects_a_problem_with_fewer_than_k_samples():
    with pytest.raises(PipelineError) as err:
        summarize(five_samples(), 3, model="m", benchmark="aime25", profile="tiny")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("m/aime25: problem 'p1' has 2 samples, fewer than k=3")


def test_summarize_rejects_duplicate_sample_index():
    samples = five_samples() + [sample("p1", 1, "Final Answer: 4")]
    with pytest.raises(PipelineError, match="problem 'p1' has sample_index 1 twice"):
        summarize(samples, 2, model="m", benchmark="b", profile="tiny")


# ---------------------------------------------------------------- jobs and generation


class EchoEngine:
    """Answers each prompt with its length; records the prompts of every `generate` call."""

    def __init__(self):
        self.calls: list[list] = []

    def generate(self, prompt_ids, num_generations):
        assert num_generations == 1
        self.calls.append(list(prompt_ids))
        return [SimpleNamespace(text=f"Final Answer: {len(ids)}", completion_ids=[0, 1, 2],
                                truncated=False) for ids in prompt_ids]


PROBLEMS = {"aime": [{"id": 1, "question": "1+1?", "ground_truth": "2", "answer_kind": "aime"},
                     {"id": 2, "question": "2+2?", "ground_truth": "4", "answer_kind": "aime"}],
            "math": [{"id": "m", "question": "What is 3+3?", "ground_truth": "6", "answer_kind": "math"}]}


def test_benchmark_jobs_are_k_per_problem_in_order_sharing_one_prompt(tokenizer):
    jobs = benchmark_jobs(tokenizer, {"aime": (PROBLEMS["aime"], 2), "math": (PROBLEMS["math"], 1)})
    assert [job.key for job in jobs] == [("aime", "1", 0), ("aime", "1", 1), ("aime", "2", 0),
                                         ("aime", "2", 1), ("math", "m", 0)]
    assert jobs[0].prompt_ids is jobs[1].prompt_ids and jobs[0].prompt_ids != jobs[2].prompt_ids


def test_benchmarks_share_one_engine_call_and_chunks_give_the_same_samples(tokenizer):
    benchmarks = {"aime": (PROBLEMS["aime"], 2), "math": (PROBLEMS["math"], 1)}
    engine = EchoEngine()
    jobs = benchmark_jobs(tokenizer, benchmarks)
    together = generate_jobs(engine, jobs)
    assert len(engine.calls) == 1 and len(engine.calls[0]) == 5
    grouped = by_benchmark(jobs, {job.key: s for job, s in zip(jobs, together, strict=True)}, benchmarks)
    assert [len(grouped[name]) for name in benchmarks] == [4, 1]
    chunked = generate_jobs(engine, jobs[:3]) + generate_jobs(engine, jobs[3:])
    assert chunked == together == grouped["aime"] + grouped["math"]
    assert chunked[4] == Sample("m", 0, f"Final Answer: {len(jobs[4].prompt_ids)}", "6", "math", 3, False)
    assert generate_jobs(engine, []) == [] and len(engine.calls) == 3   # no call for no jobs
