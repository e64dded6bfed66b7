"""Answer checking, reward values and reward schedules (parallel_r1/rewards.py)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel_r1.config import from_mapping
from parallel_r1.errors import PipelineError
from parallel_r1.format import parallel_ratio
from parallel_r1.rewards import (
    ACCURACY,
    CHECKERS,
    REWARDS,
    TIERED,
    RewardConfig,
    build_reward,
    completion_texts,
    extract_final_answer,
    is_correct,
    reward_type_at,
    strip_tags,
)

TEACHER_DEMOS = Path("/work/shared/data/teacher_demos_gsm8k.jsonl")
BLOCK = (
    "<Parallel><Path>6 * 7 = 42</Path><Path>7 + 7 + 7 + 7 + 7 + 7 = 42</Path></Parallel>"
    "<Summary>Both give 42.</Summary>\n"
)
BROKEN_BLOCK = "<Parallel><Path>6 * 7 = 42</Path></Parallel><Summary>Only one path.</Summary>\n"


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as lines:  # not splitlines(): texts hold U+2028
        return [json.loads(line) for line in lines if line.strip()]


def response(answer: str, block: str = "") -> str:
    return f"We multiply 6 by 7.\n{block}So the result follows.\nFinal Answer: {answer}"


@pytest.fixture(scope="module")
def trainer_state():
    """A real transformers TrainerState at a given global_step (imported once: it loads torch)."""
    from transformers import TrainerState

    return lambda global_step: TrainerState(global_step=global_step)


# ---------------------------------------------------------------- answer checking


@pytest.mark.parametrize("checker", CHECKERS)
def test_teacher_demos_are_mostly_correct(checker):
    rows = read_jsonl(TEACHER_DEMOS)
    correct = [is_correct(r["completion"], r["ground_truth"], "gsm8k", checker) for r in rows]
    rate = sum(correct) / len(rows)
    print(f"teacher demos accuracy ({checker}): {rate:.3f} over {len(rows)} rows")
    assert len(rows) == 300
    assert rate >= 0.9


def test_teacher_demos_count_dollar_decimals_as_integers():
    rows = read_jsonl(TEACHER_DEMOS)
    dollar_rows = [r for r in rows if extract_final_answer(r["completion"]).startswith("$")]
    assert dollar_rows, "the real teacher writes answers like '$9.00'"
    assert all(is_correct(r["completion"], r["ground_truth"], "gsm8k") for r in dollar_rows)


@pytest.mark.parametrize("kind", ["gsm8k", "math"])
@pytest.mark.parametrize("checker", CHECKERS)
def test_last_final_answer_line_wins(kind, checker):
    text = "Final Answer: 41\nWait, I recount.\nFinal Answer: 42"
    assert is_correct(text, "42", kind, checker)
    assert not is_correct(text, "41", kind, checker)


@pytest.mark.parametrize("kind", ["gsm8k", "math"])
@pytest.mark.parametrize("checker", CHECKERS)
def test_tags_inside_the_answer_are_ignored_like_skipped_special_tokens(kind, checker):
    text = (
        "<Parallel><Path>Final Answer: 7</Path><Path>x</Path></Parallel><Summary>s</Summary>\n"
        "Final Answer: 4<Summary>2</Summary>"
    )
    assert strip_tags(text).endswith("Final Answer: 42")
    assert is_correct(text, "42", kind, checker)


def test_answer_inside_a_path_counts_when_no_later_final_answer():
    text = (
        "Intro\n<Parallel>\n<Path>Final Answer: 9</Path>\n<Path>Final Answer: 8</Path>\n</Parallel>\n"
        "<Summary>ok</Summary>"
    )
    assert is_correct(text, "8", "gsm8k")
    assert not is_correct(text, "9", "gsm8k")


@pytest.mark.parametrize("checker", CHECKERS)
def test_boxed_answers_match(checker):
    assert is_correct(response("\\boxed{42}"), "42", "math", checker)
    assert is_correct(response("\\boxed{\\frac{3}{4}}"), "\\frac{3}{4}", "math", checker)
    assert is_correct(response("\\boxed{42}"), "42", "gsm8k", checker)


def test_fraction_and_decimal_differ_under_paper_rule_but_match_under_math_verify():
    assert not is_correct(response("\\frac{1}{2}"), "0.5", "math", "paper")
    assert not is_correct(response("0.5"), "\\frac{1}{2}", "math", "paper")
    assert is_correct(response("\\frac{1}{2}"), "0.5", "math", "math_verify")
    assert is_correct(response("0.5"), "\\frac{1}{2}", "math", "math_verify")
    assert not is_correct(response("0.6"), "\\frac{1}{2}", "math", "math_verify")


def test_paper_rule_normalises_tex_shorthand_units_and_equations():
    assert is_correct(response("\\frac12"), "\\frac{1}{2}", "math")
    assert is_correct(response("x = 3"), "3", "math")
    assert is_correct(response("3 \\text{ hours}"), "3", "math")
    assert is_correct(response("$\\sqrt{2}$"), "\\sqrt2", "math")
    assert not is_correct(response("\\sqrt{3}"), "\\sqrt{2}", "math")


@pytest.mark.parametrize("kind", ["gsm8k", "math"])
@pytest.mark.parametrize("checker", CHECKERS)
def test_thousands_separators_and_dollar_signs_are_ignored(kind, checker):
    assert is_correct(response("1,000"), "1000", kind, checker)
    assert is_correct(response("$1,000"), "1000", kind, checker)
    assert is_correct(response("$18$"), "18", kind, checker)


def test_gsm8k_compares_numbers_not_strings():
    assert is_correct(response("$9.00"), "9", "gsm8k")
    assert is_correct(response("18 cards"), "18", "gsm8k")
    assert is_correct(response("$-1,250.50 in total"), "-1250.5", "gsm8k")
    assert not is_correct(response("9.01"), "9", "gsm8k")


@pytest.mark.parametrize("kind", ["gsm8k", "math"])
@pytest.mark.parametrize("checker", CHECKERS)
def test_negative_numbers_keep_their_sign(kind, checker):
    assert is_correct(response("-5"), "-5", kind, checker)
    assert not is_correct(response("5"), "-5", kind, checker)
    assert not is_correct(response("-5"), "5", kind, checker)


@pytest.mark.parametrize("kind", ["gsm8k", "math"])
@pytest.mark.parametrize("checker", CHECKERS)
def test_missing_or_truncated_final_answer_is_wrong(kind, checker):
    assert not is_correct("6 * 7 = 42, so the answer is 42.", "42", kind, checker)
    assert not is_correct("6 * 7 = 42, so the answer is 42.\nFinal Ans", "42", kind, checker)
    assert not is_correct("6 * 7 = 42\nFinal Answer: 4", "42", kind, checker)
    assert not is_correct("", "42", kind, checker)


def test_final_answer_is_case_insensitive():
    assert is_correct("final answer: 42", "42", "gsm8k")
    assert is_correct("FINAL ANSWER:42", "42", "math")


def test_paper_math_rule_reads_only_the_last_300_characters():
    text = "Final Answer: 42\n" + "A long afterthought without any answer. " * 10
    assert len(text) > 300 + len("Final Answer: 42\n")
    assert not is_correct(text, "42", "math", "paper")
    assert is_correct(text, "42", "gsm8k", "paper")
    assert is_correct(text, "42", "math", "math_verify")


def test_unknown_answer_kind_or_checker_is_a_one_line_pipeline_error():
    with pytest.raises(PipelineError, match="answer_kind 'aime'") as kind_error:
        is_correct(response("42"), "42", "aime")
    with pytest.raises(PipelineError, match="checker 'sympy'") as checker_error:
        is_correct(response("42"), "42", "math", "sympy")
    assert "\n" not in str(kind_error.value) and "\n" not in str(checker_error.value)


def test_non_numeric_gsm8k_ground_truth_is_a_pipeline_error():
    with pytest.raises(PipelineError, match="not a number"):
        is_correct(response("42"), "forty-two", "gsm8k")


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=-10**12, max_value=10**12), st.sampled_from(["", "$"]))
def test_integers_with_separators_match_their_plain_form_under_gsm8k_rule(number, dollar):
    sign, magnitude = ("-" if number < 0 else ""), abs(number)
    written = f"{sign}{dollar}{magnitude:,}"
    assert is_correct(response(written), str(number), "gsm8k")
    assert not is_correct(response(written), str(number + 1), "gsm8k")


# ---------------------------------------------------------------- schedules


def test_alternating_uses_tiered_exactly_on_the_last_two_steps_of_each_window():
    tiered = [s for s in range(1, 31) if reward_type_at("alternating", s) == TIERED]
    assert tiered == [9, 10, 19, 20, 29, 30]
    assert {reward_type_at("alternating", s) for s in range(1, 31)} == {ACCURACY, TIERED}


def test_alternating_follows_window_and_tiered_steps():
    config = RewardConfig(window=5, tiered_steps=1)
    assert [s for s in range(1, 16) if reward_type_at("alternating", s, config) == TIERED] == [5, 10, 15]


def test_scaffold_alternates_until_switch_step_then_uses_accuracy_only():
    assert reward_type_at("scaffold", 199) == TIERED
    assert reward_type_at("scaffold", 200) == TIERED
    assert all(reward_type_at("scaffold", s) == ACCURACY for s in range(201, 231))
    config = RewardConfig(switch_step=15)
    assert [s for s in range(1, 31) if reward_type_at("scaffold", s, config) == TIERED] == [9, 10]


def test_static_rewards_never_change_type():
    for name in ("accuracy", "parallel_times_accuracy", "tiered", "parallel_only"):
        assert {reward_type_at(name, s) for s in range(1, 50)} == {name}


def test_unknown_reward_name_lists_known_names():
    with pytest.raises(PipelineError) as error:
        build_reward("accuracy_v2")
    message = str(error.value)
    assert "accuracy_v2" in message and "\n" not in message
    assert all(name in message for name in REWARDS)
    with pytest.raises(PipelineError, match="known rewards"):
        reward_type_at("nope", 1)


def test_reward_config_rejects_bad_values_and_unknown_params():
    with pytest.raises(PipelineError, match="tiered_steps"):
        RewardConfig(window=10, tiered_steps=11)
    with pytest.raises(PipelineError, match="checker"):
        RewardConfig(checker="exact")
    with pytest.raises(PipelineError, match="^window: expected int, got 'ten'$"):
        RewardConfig(window="ten")
    with pytest.raises(PipelineError, match="^params.yaml rewards: unknown key 'windw'"):
        from_mapping(RewardConfig, {"windw": 10}, "params.yaml rewards")
    assert from_mapping(RewardConfig, {"window": 4, "tiered_steps": 1}, "params.yaml rewards").window == 4


# ---------------------------------------------------------------- reward functions

HAND_RESPONSES = [
    response("42", BLOCK),  # correct, well-formed block
    response("42"),  # correct, no block
    response("41", BLOCK),  # wrong, well-formed block
    response("41"),  # wrong, no block
    response("42", BROKEN_BLOCK),  # correct, malformed block (one path)
]
EXPECTED = {
    "accuracy": [1.0, 1.0, -1.0, -1.0, 1.0],
    "parallel_times_accuracy": [1.0, -1.0, -1.0, -1.0, -1.0],
    "tiered": [1.2, 1.0, -1.0, -1.0, -1.0],
    "parallel_only": [1.0, -1.0, 1.0, -1.0, -1.0],
}


def call(reward, completions, **kwargs):
    n = len(completions)
    kwargs.setdefault("ground_truth", ["42"] * n)
    kwargs.setdefault("answer_kind", ["gsm8k"] * n)
    return reward(prompts=["What is 6 * 7?"] * n, completions=completions, completion_ids=None, **kwargs)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_reward_type_scores_hand_written_responses(name):
    assert call(build_reward(name), HAND_RESPONSES) == pytest.approx(EXPECTED[name])


def test_tiered_values_come_from_config():
    config = RewardConfig(tiered_parallel_reward=2.0, tiered_correct_reward=0.5, incorrect_reward=0.0)
    assert call(build_reward("tiered", config), HAND_RESPONSES) == pytest.approx([2.0, 0.5, 0.0, 0.0, 0.0])


def test_math_answers_and_math_verify_checker_reach_the_reward():
    completions = [response("\\frac{1}{2}", BLOCK), response("0.5")]
    kwargs = {"ground_truth": ["0.5", "0.5"], "answer_kind": ["math", "math"]}
    assert call(build_reward("accuracy"), completions, **kwargs) == [-1.0, 1.0]
    verified = build_reward("accuracy", RewardConfig(checker="math_verify"))
    assert call(verified, completions, **kwargs) == [1.0, 1.0]


def test_chat_message_completions_are_read():
    messages = [[{"role": "assistant", "content": text}] for text in HAND_RESPONSES]
    assert call(build_reward("tiered"), messages) == pytest.approx(EXPECTED["tiered"])
    assert completion_texts([[{"role": "assistant", "content": [{"type": "text", "text": "hi"}]}]]) == ["hi"]


def test_completion_text_overrides_tag_stripped_completions():
    stripped = [strip_tags(text) for text in HAND_RESPONSES]
    reward = build_reward("parallel_times_accuracy")
    assert call(reward, stripped) == [-1.0] * 5, "without tags no block can be seen"
    assert call(reward, stripped, completion_text=HAND_RESPONSES) == EXPECTED["parallel_times_accuracy"]


def test_alternating_reward_reads_the_step_from_trainer_state(trainer_state):
    reward, logged = build_reward("alternating"), []
    log = lambda name, value: logged.append((name, value))  # noqa: E731
    at_step_8 = call(reward, HAND_RESPONSES, trainer_state=trainer_state(7), log_metric=log)
    at_step_9 = call(reward, HAND_RESPONSES, trainer_state=trainer_state(8), log_metric=log)
    assert at_step_8 == pytest.approx(EXPECTED["accuracy"])
    assert at_step_9 == pytest.approx(EXPECTED["tiered"])
    assert [value for name, value in logged if name == "reward_type_tiered"] == [0.0, 1.0]


def test_scaffold_reward_switches_to_accuracy_after_switch_step(trainer_state):
    reward = build_reward("scaffold", RewardConfig(switch_step=20))
    assert call(reward, HAND_RESPONSES, trainer_state=trainer_state(19)) == pytest.approx(EXPECTED["tiered"])
    after_switch = call(reward, HAND_RESPONSES, trainer_state=trainer_state(29))
    assert after_switch == pytest.approx(EXPECTED["accuracy"])


def test_scheduled_reward_without_trainer_state_is_a_pipeline_error():
    with pytest.raises(PipelineError, match="trainer_state"):
        call(build_reward("alternating"), HAND_RESPONSES)


def test_reward_logs_batch_accuracy_and_parallel_ratio():
    logged = {}
    call(build_reward("accuracy"), HAND_RESPONSES, log_metric=logged.__setitem__)
    assert logged["accuracy"] == pytest.approx(3 / 5)
    assert logged["parallel_ratio"] == pytest.approx(parallel_ratio(HAND_RESPONSES)) == pytest.approx(2 / 5)
    assert logged["reward_type_tiered"] == 0.0


def test_missing_or_misaligned_dataset_columns_are_pipeline_errors():
    reward = build_reward("accuracy")
    with pytest.raises(PipelineError, match="'ground_truth' is missing"):
        reward(prompts=["p"], completions=["Final Answer: 1"], answer_kind=["gsm8k"])
    with pytest.raises(PipelineError, match="'answer_kind' has 2 values for 1"):
        call(reward, ["Final Answer: 1"], answer_kind=["gsm8k", "gsm8k"])
    with pytest.raises(PipelineError, match="completion_text has 1 items for 2"):
        call(reward, ["a", "b"], completion_text=["a"])


def test_built_reward_has_a_readable_name_and_survives_pickling():
    for name in REWARDS:
        reward = build_reward(name)
        assert reward.__name__ == name
        clone = pickle.loads(pickle.dumps(reward))
        assert clone.__name__ == name and clone.config == reward.config
    clone = pickle.loads(pickle.dumps(build_reward("tiered")))
    assert call(clone, HAND_RESPONSES) == pytest.approx(EXPECTED["tiered"])
