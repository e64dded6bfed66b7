"""The held-out check (parallel_r1/heldout.py, stage `heldout`): paired differences per question and
their percentile bootstrap interval, on fixed samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parallel_r1 import heldout
from parallel_r1.errors import PipelineError
from parallel_r1.io import write_json

BLOCK_SAME = ("<Parallel><Path>six times seven</Path><Path>six times seven</Path></Parallel>\n"
              "<Summary>s</Summary>\nFinal Answer: 42")
BLOCK_APART = ("<Parallel><Path>6 * 7 = 42</Path><Path>seven sixes make forty-two</Path></Parallel>\n"
               "<Summary>s</Summary>\nFinal Answer: 42")


def row(qid: str, parallel: bool, response: str = "Final Answer: 1", diversity: float | None = None,
        correct: bool = False) -> dict:
    return {"problem_id": qid, "sample_index": 0, "response": response, "parallel": parallel,
            "path_diversity": diversity, "correct": correct}


def test_constant_differences_give_a_degenerate_interval_at_that_value():
    assert heldout.bootstrap_interval([0.25] * 32, seed=1) == pytest.approx((0.25, 0.25))


def test_two_point_interval_matches_the_exact_bootstrap_distribution():
    # resampled means of [0, 1] with n = 2: 0 (1/4), 0.5 (1/2), 1 (1/4): 2.5th, 97.5th percentiles 0 and 1
    assert heldout.bootstrap_interval([0.0, 1.0], seed=7, resamples=20_000) == (0.0, 1.0)


def test_interval_is_seeded_and_brackets_the_mean():
    diffs = [1, 0, 0, 1, 1, 0, 1, 1, 0, 1, -1, 1, 0, 1, 1, 1] * 2
    low, high = heldout.bootstrap_interval(diffs, seed=3)
    assert (low, high) == heldout.bootstrap_interval(diffs, seed=3)
    mean = sum(diffs) / len(diffs)
    assert low < mean < high
    # a normal approximation of the mean's 95% interval, which the percentile bootstrap tracks at n = 32
    sd = (sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)) ** 0.5 / len(diffs) ** 0.5
    assert low == pytest.approx(mean - 1.96 * sd, abs=0.05)
    assert high == pytest.approx(mean + 1.96 * sd, abs=0.05)


def test_paired_uses_common_questions_and_reports_means():
    interval = heldout.paired({"a": 0.0, "b": 1.0, "c": 0.5}, {"a": 1.0, "b": 1.0, "d": 0.0}, seed=0)
    assert interval is not None
    assert (interval.n, interval.init_mean, interval.final_mean) == (2, 0.5, 1.0)
    assert interval.mean_difference == 0.5
    assert heldout.paired({"a": 1.0}, {"b": 1.0}, seed=0) is None


def test_compare_on_fixed_samples():
    init = [row(str(q), parallel=q < 8, response=BLOCK_SAME if q < 8 else "Final Answer: 1",
                diversity=0.0 if q < 8 else None) for q in range(32)]
    final = [row(str(q), parallel=q < 24, response=BLOCK_APART if q < 24 else "Final Answer: 1",
                 diversity=1.0 if q < 24 else None) for q in range(32)]
    result = heldout.compare(init, final, seed=0, where=("init.jsonl", "final.jsonl"))
    ratio = result["parallel_ratio"]
    assert ratio is not None and ratio.n == 32
    assert (ratio.init_mean, ratio.final_mean, ratio.mean_difference) == (0.25, 0.75, 0.5)
    assert ratio.excludes_zero and ratio.low > 0.3
    diversity = result["path_diversity"]
    assert diversity is not None and diversity.n == 8 and diversity.mean_difference == 1.0
    bleu = result["one_minus_self_bleu"]
    assert bleu is not None and bleu.n == 8 and bleu.init_mean == pytest.approx(0.0, abs=1e-9)
    assert bleu.final_mean == pytest.approx(1.0)
    rewarded = result["one_minus_self_bleu_any_block"]  # every question: 0 without a block
    assert rewarded is not None and rewarded.n == 32 and rewarded.init_mean == pytest.approx(0.0, abs=1e-9)
    assert rewarded.final_mean == pytest.approx(0.75)
    accuracy = result["accuracy"]
    assert accuracy is not None and accuracy.mean_difference == 0 and not accuracy.excludes_zero
    text = heldout.markdown({"run": result}, {"run": "`sft_unseen`"}, "gsm8k", "> banner")
    assert "| `run` | `sft_unseen` | parallel ratio | 32 | 0.250 | 0.750 | +0.500 |" in text
    assert json.loads(json.dumps(heldout.as_json({"run": result})))["run"]["parallel_ratio"]["excludes_zero"]


def test_diverse_paths_in_a_block_that_fails_the_format_check_count_only_in_the_any_block_row():
    broken = BLOCK_APART + "</Path>"  # a stray closing tag: not well-formed, but the span is closed
    init = [row(str(q), parallel=False) for q in range(32)]
    final = [row(str(q), parallel=False, response=broken) for q in range(32)]
    result = heldout.compare(init, final, seed=0, where=("init.jsonl", "final.jsonl"))
    assert result["one_minus_self_bleu"] is None and result["path_diversity"] is None
    ratio, rewarded = result["parallel_ratio"], result["one_minus_self_bleu_any_block"]
    assert ratio is not None and ratio.mean_difference == 0
    assert rewarded is not None and rewarded.mean_difference == pytest.approx(1.0) and rewarded.excludes_zero


def test_the_accuracy_row_pairs_every_question_on_fixed_samples():
    """Init right on 8 of 64 questions, final on 24 (every init-right one kept): +0.250, beyond noise."""
    init = [row(str(q), parallel=False, correct=q < 8) for q in range(64)]
    final = [row(str(q), parallel=False, correct=q < 24) for q in range(64)]
    accuracy = heldout.compare(init, final, seed=0, where=("init.jsonl", "final.jsonl"))["accuracy"]
    assert accuracy is not None and accuracy.n == 64
    assert (accuracy.init_mean, accuracy.final_mean, accuracy.mean_difference) == (0.125, 0.375, 0.25)
    assert 0.1 < accuracy.low < 0.25 < accuracy.high < 0.4
    init_cell = "`base` as `grpo` samples"
    text = heldout.markdown({"grpo": {"accuracy": accuracy}}, {"grpo": init_cell}, "arithmetic", "> banner")
    assert (f"| `grpo` | {init_cell} | accuracy | 64 | 0.125 | 0.375 | +0.250 | "
            f"[+{accuracy.low:.3f}, +{accuracy.high:.3f}] | yes, up |") in text
    # two samples a question: a question's value is its mean, 0.5 where one of two is right
    pairs = [row("a", False, correct=True), {**row("a", False), "sample_index": 1}]
    assert heldout.per_question(pairs, "accuracy", "x.jsonl") == {"a": 0.5}


def test_an_init_and_final_sampled_with_different_prompts_are_an_error_naming_both_files():
    base = {"prompt": "parallel", "variant": "seen", "parallel_rollout": True}
    heldout.same_rollout(base, dict(base), ("a.json", "b.json"), "s1")   # the same: no error
    with pytest.raises(PipelineError, match=r"^a\.json and b\.json: the init and final of 'grpo' sampled "
                                            r"differently \(prompt 'parallel' vs 'baseline', "
                                            r"parallel_rollout True vs False\); list 'grpo' in params.yaml "
                                            r"evaluate.inits"):
        heldout.same_rollout(base, {**base, "prompt": "baseline", "parallel_rollout": False},
                             ("a.json", "b.json"), "grpo")
    with pytest.raises(PipelineError, match=r"^b\.json: no record of the prompt and rollout mode it was "
                                            r"sampled with \(written before evaluations recorded them\): run "
                                            r"its evaluation again$"):
        heldout.same_rollout(base, {"mean_at_k": 0.5}, ("a.json", "b.json"), "grpo")


def test_different_question_sets_are_an_error_naming_the_file():
    with pytest.raises(PipelineError, match="^final.jsonl: its questions differ from init.jsonl's"):
        heldout.compare([row("a", False)], [row("b", False)], seed=0, where=("init.jsonl", "final.jsonl"))
    with pytest.raises(PipelineError, match="init.jsonl row 1: missing field"):
        heldout.compare([{"problem_id": "a"}], [row("a", False)], seed=0, where=("init.jsonl", "final.jsonl"))


def test_stage_writes_report_and_metrics(tmp_path: Path, monkeypatch):
    from stages import heldout as stage

    monkeypatch.chdir(tmp_path)
    parallel_mode = {"prompt": "parallel", "variant": "unseen", "parallel_rollout": True}
    for model, parallel in (("sft_unseen", False), ("run_a", True), ("run_a.init", False)):
        folder = tmp_path / "data" / "samples" / model
        folder.mkdir(parents=True)
        rows = [row(str(q), parallel, BLOCK_APART if parallel else "x", 1.0 if parallel else None)
                for q in range(32)]
        (folder / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        mode = {**parallel_mode, "prompt": "baseline"} if model == "sft_unseen" else parallel_mode
        write_json(tmp_path / "metrics" / "eval" / model / "gsm8k.json", {"mean_at_k": 0.0, **mode})
    params = {"profile": "tiny", "seed": 0, "rl_runs": {"run_a": {"init": "sft_unseen"}},
              "reports": {"heldout_runs": ["run_a"]}, "evaluate": {"inits": {"run_a": "sft_unseen"}}}
    out = stage.build(params)   # the init as run_a samples (run_a.init), not sft_unseen's own evaluation
    expected = ("| `run_a` | `sft_unseen` as `run_a` samples | parallel ratio | 32 | 0.000 | 1.000 | "
                "+1.000 | [+1.000, +1.000] | yes, up |")
    assert expected in out.read_text()
    assert json.loads((tmp_path / "metrics" / "heldout.json").read_text())["run_a"]["path_diversity"] is None
    with pytest.raises(PipelineError, match="reports.heldout_runs: 'nope' is not an rl_runs entry"):
        stage.build({**params, "reports": {"heldout_runs": ["nope"]}})
    with pytest.raises(PipelineError, match=r"heldout_runs: 'run_a' needs evaluations of sft_unseen, which "
                                            r"evaluate.models does not list$"):
        stage.build({**params, "evaluate": {"models": ["run_a"]}})
    # without evaluate.inits the pair is sft_unseen's own evaluation, sampled with another prompt
    with pytest.raises(PipelineError, match=r"^metrics/eval/sft_unseen/gsm8k\.json and "
                                            r"metrics/eval/run_a/gsm8k\.json: the init and final of 'run_a' "
                                            r"sampled differently \(prompt 'baseline' vs 'parallel'\)"):
        stage.build({**params, "evaluate": {}})
