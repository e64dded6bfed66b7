"""The diversity-aware parallel reward (rewards.PARALLEL_DIVERSITY, format.self_bleu): the authors'
released `math_dapo_accuracy_add_parallel_add_diversity.py`, accuracy (+-1) + 1 for a `<Parallel>`
- 0.3 x self-BLEU."""

from __future__ import annotations

from itertools import combinations

import pytest
import sacrebleu

from parallel_r1.errors import PipelineError
from parallel_r1.format import NO_BLOCK_SELF_BLEU, paths_self_bleu, self_bleu
from parallel_r1.rewards import PARALLEL_DIVERSITY, SCHEDULE_KNOBS, RewardConfig, build_reward


def response(answer: str, block: str = "") -> str:
    return f"We multiply 6 by 7.\n{block}So the result follows.\nFinal Answer: {answer}"


def block(*paths: str, summary: str = "Both agree.") -> str:
    """A block in the rollout engine's layout."""
    paths_text = "".join(f"<Path>{p}</Path>" for p in paths)
    return f"<Parallel>{paths_text}</Parallel>\n<Summary>{summary}</Summary>\n"


SAME = "six times seven is forty two"
IDENTICAL = block(SAME, SAME)
DISJOINT = block("6 * 7 = 42", "seven sixes make forty-two")   # no 13a token in common
UNCLOSED = "<Parallel><Path>six times seven is"   # cut at the token budget
ONE_PATH = "<Parallel><Path>6 * 7 = 42</Path></Parallel>\n<Summary>one path</Summary>\n"


def call(reward, completions, truth="42"):
    n = len(completions)
    return reward(prompts=["What is 6 * 7?"] * n, completions=completions, completion_ids=None,
                  ground_truth=[truth] * n, answer_kind=["gsm8k"] * n)


def official(correct: bool, text: str, blocks: list[list[str]]) -> float:
    """The released formula, written from its definition for paths listed by hand: +-1, + 1 when the text
    holds `<Parallel>`, - 0.3 x the mean over blocks of the mean pairwise sacrebleu sentence BLEU / 100
    (1.0 without a block or for a block of < 2 paths)."""
    def block_bleu(paths: list[str]) -> float:
        pairs = [sacrebleu.sentence_bleu(p, [q]).score / 100 for p, q in combinations(paths, 2)]
        return sum(pairs) / len(pairs) if pairs else 1.0

    bleu = sum(block_bleu(paths) for paths in blocks) / len(blocks) if blocks else 1.0
    return (1.0 if correct else -1.0) + (1.0 if "<Parallel>" in text else 0.0) - 0.3 * bleu


# ---------------------------------------------------------------- hand-computed values


@pytest.mark.parametrize(("text", "bleu"), [(IDENTICAL, 1.0), (DISJOINT, 0.0), ("no block here", 1.0),
                                            (UNCLOSED, 1.0), (ONE_PATH, 1.0)])
def test_self_bleu_of_identical_disjoint_absent_and_malformed_blocks(text, bleu):
    assert self_bleu(text) == pytest.approx(bleu)


@pytest.mark.parametrize(("text", "if_correct", "if_wrong"), [
    (IDENTICAL, 1 + 1 - 0.3, -1 + 1 - 0.3),   # copies: the bonus, less the whole penalty
    (DISJOINT, 1 + 1 - 0.0, -1 + 1 - 0.0),    # nothing shared: the bonus, no penalty
    ("", 1 - 0.3, -1 - 0.3),                  # no block: self-BLEU counts as 1
    (UNCLOSED, 1 + 1 - 0.3, -1 + 1 - 0.3),    # officially a `<Parallel>` earns the bonus, closed or not
    (ONE_PATH, 1 + 1 - 0.3, -1 + 1 - 0.3),    # a block of one path is "fully homogeneous"
])
def test_reward_of_hand_written_responses(text, if_correct, if_wrong):
    reward = build_reward(PARALLEL_DIVERSITY)
    assert call(reward, [response("42", text), response("41", text)]) == pytest.approx([if_correct, if_wrong])


@pytest.mark.parametrize(("text", "if_wrong"), [
    (IDENTICAL, -1 + 1 - 0.3),   # a well-formed block still earns the bonus
    (UNCLOSED, -1 + 0 - 0.3),    # an opened, never closed block earns nothing, as no block at all
    ("", -1 - 0.3),
])
def test_the_bonus_can_require_a_well_formed_block(text, if_wrong):
    config = RewardConfig(parallel_bonus_needs="well_formed")
    assert call(build_reward(PARALLEL_DIVERSITY, config), [response("41", text)]) == pytest.approx([if_wrong])
    with pytest.raises(PipelineError, match="parallel_bonus_needs"):
        RewardConfig(parallel_bonus_needs="closed")


def test_self_bleu_can_read_only_well_formed_blocks():
    broken = DISJOINT + "</Path>"  # a stray closing tag after the block: closed spans, not well-formed
    texts = [response("41", broken), response("41", DISJOINT), response("41")]
    official_reading = RewardConfig(parallel_bonus_needs="well_formed")
    assert call(build_reward(PARALLEL_DIVERSITY, official_reading), texts) == pytest.approx(
        [-1 + 0 - 0.0, -1 + 1 - 0.0, -1 - 0.3])  # the broken block's diverse paths lower its penalty
    strict = RewardConfig(parallel_bonus_needs="well_formed", self_bleu_reads="well_formed")
    assert call(build_reward(PARALLEL_DIVERSITY, strict), texts) == pytest.approx(
        [-1 - 0.3, -1 + 1 - 0.0, -1 - 0.3])  # ... here it counts as no block
    with pytest.raises(PipelineError, match="self_bleu_reads"):
        RewardConfig(self_bleu_reads="closed")


def test_more_diverse_paths_earn_more_and_every_value_lies_in_the_formula_range():
    reward = build_reward(PARALLEL_DIVERSITY)
    near = block("six times seven is forty two", "six times seven is 42")
    values = call(reward, [response("41", IDENTICAL), response("41", near), response("41", DISJOINT)])
    assert values[0] < values[1] < values[2]
    assert all(-1.3 - 1e-9 <= v <= 2.0 + 1e-9 for v in values)


def test_constants_are_params():
    config = RewardConfig(parallel_bonus=0.5, self_bleu_weight=1.0, correct_reward=2.0, incorrect_reward=0.0)
    reward = build_reward(PARALLEL_DIVERSITY, config)
    assert call(reward, [response("42", IDENTICAL), response("41", DISJOINT), response("41")]) == \
        pytest.approx([2.0 + 0.5 - 1.0, 0.0 + 0.5 - 0.0, 0.0 - 1.0])
    assert set(SCHEDULE_KNOBS[PARALLEL_DIVERSITY]) == {"parallel_bonus", "self_bleu_weight",
                                                       "parallel_bonus_needs", "self_bleu_reads"}
    with pytest.raises(PipelineError, match="self_bleu_weight"):
        RewardConfig(self_bleu_weight="0.3")


# ---------------------------------------------------------------- against the official formula


FIXED = [  # (answer, text, its blocks' paths listed by hand)
    ("42", block("6 * 7 = 42, so the answer is 42.", "7 + 7 + 7 + 7 + 7 + 7 = 42, the answer is 42."),
     [["6 * 7 = 42, so the answer is 42.", "7 + 7 + 7 + 7 + 7 + 7 = 42, the answer is 42."]]),
    ("41", block("Half of 84 is 42.", "Half of 84 is 42.", "84 / 2 = 42"),
     [["Half of 84 is 42.", "Half of 84 is 42.", "84 / 2 = 42"]]),
    ("42", block("a b c d e", "a b c d f") + "Then again.\n" + block("x y", "z w"),
     [["a b c d e", "a b c d f"], ["x y", "z w"]]),
    ("42", "<Parallel><Path>multi\nline path</Path><Path>multi\nline path too</Path></Parallel>",
     [["multi\nline path", "multi\nline path too"]]),   # no summary: the official regex still reads it
    ("42", "", []),
]


@pytest.mark.parametrize(("answer", "text", "paths"), FIXED)
def test_reward_matches_the_official_formula_on_fixed_texts(answer, text, paths):
    completion = response(answer, text)
    assert call(build_reward(PARALLEL_DIVERSITY), [completion]) == \
        pytest.approx([official(answer == "42", completion, paths)])


def test_paths_self_bleu_averages_every_unordered_pair_in_order():
    paths = ["a b c d e", "a b c d f", "a b x y z"]
    expected = [sacrebleu.sentence_bleu(p, [q]).score / 100 for p, q in combinations(paths, 2)]
    assert paths_self_bleu(paths) == pytest.approx(sum(expected) / 3)
    assert paths_self_bleu(["only one"]) == paths_self_bleu([]) == NO_BLOCK_SELF_BLEU


def test_reward_logs_the_batch_self_bleu():
    logged: dict[str, float] = {}
    reward = build_reward(PARALLEL_DIVERSITY)
    reward(prompts=["q", "q"], completions=[response("42", IDENTICAL), response("42", DISJOINT)],
           ground_truth=["42", "42"], answer_kind=["gsm8k", "gsm8k"], log_metric=logged.__setitem__)
    assert logged["self_bleu"] == pytest.approx(0.5)
