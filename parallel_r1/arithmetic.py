"""Generated arithmetic word problems: a problem set a small model solves some of the time.

Why: GRPO moves a weight only where a prompt's rollouts get different rewards. A 135M model answers
GSM8K and DAPO problems ~never, so on the small profile every accuracy-rewarded group is all -1 and the
paper's reward schedules cannot be compared. It does solve one-step, single-digit word problems some of the
time (docs/rl_small_profile.md), which is the signal the accuracy rewards need at its size.

A level is a set of operations, how many of them chain (`steps`), the operand range and the wordings
(`templates`). Every question of a level is enumerated (template x name x item x operands), shuffled under
a seed and split: the first
`heldout` questions are the held-out set, the rest the training set, so the two share no question and
the same seed and knobs always give the same sets. Ground truths are computed from the operands and stay
non-negative (a subtraction never takes more than there is). Records have the common problem shape
(`data.py`) with `answer_kind` "gsm8k": the reward's numeric answer rule checks them.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Iterator

from parallel_r1.config import check_fields
from parallel_r1.errors import PipelineError

OPERATIONS = ("add", "sub")
SPLITS = ("train", "heldout")
NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia")
ITEMS = ("apples", "pencils", "marbles", "books", "cookies", "stickers")
COLORS = ("red", "blue", "green", "yellow", "white", "black")
# "change": a count, then one sentence per operation (a chain of `steps` of them), then the question.
OPENING = "{name} has {a} {item}."
STEP_TEXT = {
    "add": ("{name} buys {n} more {item}.", "Then {name} gets {n} more {item}."),
    "sub": ("{name} gives {n} {item} to a friend.", "Then {name} gives {n} {item} away."),
}
QUESTION = "How many {item} does {name} have now?"
# The wordings a level draws from, and the operations each can write. "colors" and "together" state every
# operand at once (no change over time); SFT-Unseen is right on them about twice as often as on "change"
# (docs/rl_small_profile.md), so they give the accuracy rewards more groups with a spread.
TEMPLATES = {"change": OPERATIONS, "colors": ("add",), "together": ("add",)}
# How many operands a wording can name: one colour, or one person, each.
MAX_OPERANDS = {"colors": len(COLORS), "together": len(NAMES)}


@dataclass(frozen=True)
class ArithmeticLevel:
    """One difficulty level (params.yaml `data.arithmetic.levels.<level>`).

    operations: which of OPERATIONS a step may be; steps: how many operations chain (1: "a + b");
    operand_min / operand_max: the range of every number in the question (inclusive); templates: the
    wordings (TEMPLATES), each writing every chain of the level whose operations it can express.
    """

    operations: tuple[str, ...] = ("add",)
    steps: int = field(default=1, metadata={"min": 1})
    operand_min: int = field(default=1, metadata={"min": 0})
    operand_max: int = field(default=9, metadata={"min": 1})
    templates: tuple[str, ...] = ("change",)

    def __post_init__(self) -> None:
        check_fields(self)
        unknown = sorted(set(self.operations) - set(OPERATIONS))
        if unknown or not self.operations:
            raise PipelineError(f"operations: {list(self.operations)!r} must be a non-empty list of "
                                f"{', '.join(OPERATIONS)}")
        if self.operand_min > self.operand_max:
            raise PipelineError(f"operand_min: {self.operand_min} is above operand_max {self.operand_max}")
        unknown = sorted(set(self.templates) - set(TEMPLATES))
        if unknown or not self.templates:
            raise PipelineError(f"templates: {list(self.templates)!r} must be a non-empty list of "
                                f"{', '.join(TEMPLATES)}")
        for template in self.templates:
            if not set(TEMPLATES[template]) & set(self.operations):
                raise PipelineError(f"templates: {template!r} writes only {', '.join(TEMPLATES[template])}, "
                                    f"and this level's operations are {', '.join(self.operations)}")
            most = MAX_OPERANDS.get(template)
            if most is not None and self.steps + 1 > most:
                raise PipelineError(f"templates: {template!r} names at most {most} operands, "
                                    f"and steps {self.steps} needs {self.steps + 1}")


def _chains(level: ArithmeticLevel) -> Iterator[tuple[tuple[str, ...], tuple[int, ...], int]]:
    """(operations, operands, answer) of every chain whose running total never goes below 0."""
    numbers = range(level.operand_min, level.operand_max + 1)
    for operations in itertools.product(sorted(level.operations), repeat=level.steps):
        for operands in itertools.product(numbers, repeat=level.steps + 1):
            total = operands[0]
            for operation, number in zip(operations, operands[1:], strict=True):
                total = total + number if operation == "add" else total - number
                if total < 0:
                    break
            else:
                yield operations, operands, total


def question_text(name: str, item: str, operations: tuple[str, ...], operands: tuple[int, ...],
                  template: str = "change") -> str:
    """The word problem in `template`'s wording.

    change: opening, one sentence per operation (the first plain, later ones with "Then"), question;
    colors: one person's items of each colour, then the total; together: each person's items (`name` and
    the next names of NAMES), then the total. The last two write additions only.
    """
    if template == "colors":
        colors = COLORS[:len(operands)]
        parts = [f"{number} {color} {item}" for number, color in zip(operands, colors, strict=True)]
        listed = ", ".join(parts[:-1]) + f" and {parts[-1]}"
        return f"{name} has {listed}. How many {item} does {name} have in total?"
    if template == "together":
        first = NAMES.index(name)
        people = [NAMES[(first + offset) % len(NAMES)] for offset in range(len(operands))]
        owned = " ".join(f"{person} has {number} {item}."
                         for person, number in zip(people, operands, strict=True))
        return f"{owned} How many {item} do they have together?"
    sentences = [OPENING.format(name=name, a=operands[0], item=item)]
    for index, (operation, number) in enumerate(zip(operations, operands[1:], strict=True)):
        sentences.append(STEP_TEXT[operation][min(index, 1)].format(name=name, n=number, item=item))
    sentences.append(QUESTION.format(item=item, name=name))
    return " ".join(sentences)


def level_problems(level_name: str, level: ArithmeticLevel, seed: int) -> list[dict]:
    """Every question of the level, in the seeded order the split cuts (records without `dataset`)."""
    problems = [
        {"question": question_text(name, item, operations, operands, template), "ground_truth": str(answer),
         "answer_kind": "gsm8k", "operations": list(operations), "operands": list(operands)}
        for template in level.templates
        for operations, operands, answer in _chains(level) if set(operations) <= set(TEMPLATES[template])
        for name in NAMES for item in ITEMS
    ]
    random.Random(f"{seed}:{level_name}").shuffle(problems)
    for index, problem in enumerate(problems):
        problem["id"] = f"arithmetic-{level_name}-{index}"
    return problems


def split_problems(level_name: str, level: ArithmeticLevel, seed: int, heldout: int,
                   split: str) -> list[dict]:
    """The held-out questions (the first `heldout` of the seeded order) or the training ones (the rest)."""
    if split not in SPLITS:
        raise PipelineError(f"split: {split!r} is unknown (choose from {', '.join(SPLITS)})")
    problems = level_problems(level_name, level, seed)
    if heldout < 1 or heldout >= len(problems):
        raise PipelineError(f"heldout: {heldout} questions must be >= 1 and leave some of level "
                            f"{level_name!r}'s {len(problems)} for training")
    chosen = problems[:heldout] if split == "heldout" else problems[heldout:]
    return [{key: problem[key] for key in ("id", "question", "ground_truth", "answer_kind")}
            for problem in chosen]
