"""Generated arithmetic word problems: deterministic, disjoint splits, right answers the reward can read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import REPO, one_line_error, set_param, write_profile_params
from parallel_r1.arithmetic import ArithmeticLevel, level_problems, question_text, split_problems
from parallel_r1.errors import PipelineError
from parallel_r1.io import read_jsonl
from parallel_r1.rewards import is_correct
from stages.prepare_data import arithmetic_levels
from stages.profiles import compose

SMALL, LEVELS = arithmetic_levels(compose(REPO, "small"))   # parsed as prepare_data parses them


def solve(question: str) -> int:
    """The answer read back from the question text alone: every count adds, but one given away."""
    sentences = [s for s in re.split(r"(?<=[.?])\s+", question) if s]
    total = 0
    for sentence in sentences[:-1]:
        numbers = [int(n) for n in re.findall(r"\d+", sentence)]
        total += -sum(numbers) if " gives " in sentence else sum(numbers)
    return total


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_every_ground_truth_is_right_and_read_by_the_reward_checker(level):
    problems = level_problems(level, LEVELS[level], SMALL["seed"])
    assert len(problems) > SMALL["heldout"]
    for problem in problems:
        truth = problem["ground_truth"]
        assert int(truth) == solve(problem["question"]) >= 0, problem
        assert is_correct(f"So the count is clear.\nFinal Answer: {truth}", truth, problem["answer_kind"])
        assert not is_correct(f"Final Answer: {int(truth) + 1}", truth, problem["answer_kind"])
        numbers = [int(n) for n in re.findall(r"\d+", problem["question"])]
        spec = LEVELS[level]
        assert len(numbers) == spec.steps + 1
        assert all(spec.operand_min <= n <= spec.operand_max for n in numbers)


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_the_split_is_deterministic_disjoint_and_complete(level):
    spec, seed, heldout = LEVELS[level], SMALL["seed"], SMALL["heldout"]
    train = split_problems(level, spec, seed, heldout, "train")
    held = split_problems(level, spec, seed, heldout, "heldout")
    assert len(held) == heldout >= 64
    assert held == split_problems(level, spec, seed, heldout, "heldout")   # the same seed, the same sets
    assert {p["question"] for p in train}.isdisjoint(p["question"] for p in held)
    assert len({p["question"] for p in train + held}) == len(level_problems(level, spec, seed))
    assert held != split_problems(level, spec, seed + 1, heldout, "heldout")   # another seed, another set


def test_a_level_with_two_steps_chains_two_operations_and_never_goes_below_zero():
    level = ArithmeticLevel(operations=("sub",), steps=2, operand_min=2, operand_max=4)
    problems = level_problems("x", level, 0)
    assert problems and all(int(p["ground_truth"]) >= 0 for p in problems)
    assert all(p["question"].count(" gives ") == 2 for p in problems)


def test_each_template_words_its_own_chains_and_together_they_enumerate_the_level():
    level = ArithmeticLevel(operations=("add", "sub"), steps=2, operand_min=2, operand_max=3,
                            templates=("change", "colors", "together"))
    problems = level_problems("x", level, 0)
    wordings = {"change": " now?", "colors": " in total?", "together": " together?"}
    by_template = {name: [p for p in problems if p["question"].endswith(end)]
                   for name, end in wordings.items()}
    people_and_items = 6 * 6
    # 4 operation pairs x 8 operand triples; 10 go below 0 (2 - 3, and every 2-step take-away of 2s and 3s)
    assert len(by_template["change"]) == (32 - 10) * people_and_items
    additions_only = 8 * people_and_items
    assert len(by_template["colors"]) == len(by_template["together"]) == additions_only
    assert sum(map(len, by_template.values())) == len(problems)
    assert all(p["operations"] == ["add", "add"] for p in by_template["colors"] + by_template["together"])
    assert question_text("Tom", "apples", ("add", "add"), (3, 4, 2), "colors") == (
        "Tom has 3 red apples, 4 blue apples and 2 green apples. "
        "How many apples does Tom have in total?")
    assert question_text("Mia", "books", ("add",), (5, 7), "together") == (
        "Mia has 5 books. Tom has 7 books. How many books do they have together?")


@pytest.mark.parametrize(("knobs", "message"), [
    ({"operations": ("mul",)}, r"^operations: \['mul'\] must be a non-empty list of add, sub$"),
    ({"templates": ("story",)},
     r"^templates: \['story'\] must be a non-empty list of change, colors, together$"),
    ({"operations": ("sub",), "templates": ("colors",)},
     r"^templates: 'colors' writes only add, and this level's operations are sub$"),
    ({"steps": 6, "templates": ("together",)},
     r"^templates: 'together' names at most 6 operands, and steps 6 needs 7$"),
    ({"operand_min": 5, "operand_max": 2}, r"^operand_min: 5 is above operand_max 2$"),
    ({"steps": 0}, r"^steps: must be >= 1, got 0$"),
])
def test_a_bad_level_is_named_in_one_line(knobs, message):
    with pytest.raises(PipelineError, match=message):
        ArithmeticLevel(**knobs)


def test_prepare_data_writes_the_small_profiles_sets(tmp_path, monkeypatch, mirror):
    from stages.prepare_data import main

    write_profile_params(tmp_path, "small", mirror)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PARALLEL_R1_TRACKING", "off")
    main([])
    data = compose(REPO, "small")["data"]
    for group, name in (("rl", "gsm8k"), ("rl", "dapo"), ("eval", "arithmetic")):
        spec = data[group][name]
        rows = read_jsonl(Path(f"data/{group}/{name}.jsonl"))
        expected = split_problems(spec["level"], LEVELS[spec["level"]], SMALL["seed"], SMALL["heldout"],
                                  spec["split"])[:spec["limit"]]
        assert [row["question"] for row in rows] == [p["question"] for p in expected]
        assert {row["dataset"] for row in rows} == {f"arithmetic_{spec['level']}_{spec['split']}"}
    held_level = data["eval"]["arithmetic"]["level"]
    trained = {row["question"] for row in read_jsonl(Path("data/rl/dapo.jsonl"))}
    assert data["rl"]["dapo"]["level"] == held_level   # the held-out set is the DAPO stage's level, unseen
    assert trained.isdisjoint(row["question"] for row in read_jsonl(Path("data/eval/arithmetic.jsonl")))


@pytest.mark.parametrize(("param", "value", "message"), [
    ("data.rl.dapo.level", "nosuch", "error: params.yaml data.rl.dapo.level: 'nosuch' is not a level of "
                                     "data.arithmetic.levels (known: easy, hard)"),
    ("data.rl.dapo.split", "test",
     "error: params.yaml data.rl.dapo.split: 'test' is unknown (choose from train, heldout)"),
    ("data.arithmetic.levels.hard.operand_max", "1",
     "error: params.yaml data.arithmetic.levels.hard.operand_min: 2 is above operand_max 1"),
    ("data.arithmetic.heldout", "100000",
     "error: params.yaml data.arithmetic.heldout: 100000 questions must be >= 1 and leave some of level "
     "'easy''s 1152 for training"),
    ("data.arithmetic.seed", "x",
     "error: params.yaml data.arithmetic.seed: must be an integer >= 0, got 'x'"),
])
def test_a_bad_arithmetic_param_is_named_in_one_line(tmp_path, monkeypatch, capsys, param, value, message):
    from stages.prepare_data import main

    params = write_profile_params(tmp_path, "small")
    set_param(params, param, value)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PARALLEL_R1_TRACKING", "off")
    assert one_line_error(main, capsys, []) == message
