"""Answer checking, reward functions and reward schedules for GRPO (TRL) and evaluation.

Accuracy follows the authors' rules (official VERL reward code) unless math-verify is asked for:
  - the answer is the last `Final Answer: ...` line, read from the response with the six
    parallel tags removed (the authors decode with `skip_special_tokens=True`, and the tags are
    special tokens);
  - "math" answers (DAPO, MATH, AIME, AMC): only the last 300 characters are searched, the
    answer and the ground truth get Minerva normalisation, then must match exactly;
  - "gsm8k" answers: the first number on that line, `,` and `$` removed, must equal the
    ground truth numerically (`$9.00` == `9`). The official GSM8K scorer took the *first*
    `Final Answer:` and compared strings; we take the last line, as for math, and compare
    numbers, as the paper states.
  - checker "math_verify": `math_verify.parse` / `verify` on the same last line, no window.

Reward functions have TRL's signature `fn(prompts, completions, completion_ids=None, **kwargs)`
and read the dataset columns `ground_truth` and `answer_kind` from kwargs. TRL decodes
completions with `skip_special_tokens=True`, which strips our tags, so the rollout function
passes the raw text in `completion_text`; it wins over `completions` when present.

Schedules are names resolved through one registry (`REWARDS`, `build_reward`). A schedule
picks, per step (rollout batch), one of five reward types; steps are 1-based and come from
`trainer_state.global_step // updates_per_step + 1`: a step is one rollout batch, which feeds
`updates_per_step` optimizer updates (GRPO mini-batches), and TRL generates (and scores) the
batch of step s while `global_step` still counts the (s - 1) x updates_per_step finished updates.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Literal, Mapping

from parallel_r1.config import check_fields
from parallel_r1.errors import PipelineError
from parallel_r1.format import NO_BLOCK_SELF_BLEU, PARALLEL_OPEN, TAG_PATTERN, is_parallel, self_bleu

ANSWER_KINDS = ("gsm8k", "math")
CHECKERS = ("paper", "math_verify")

MATH_WINDOW_CHARS = 300  # official: "the longest answer in MATH-500 has 159 characters"
_FINAL_ANSWER = re.compile(r"(?i)Final Answer\s*:\s*([^\n]+)")
_CHAT_SPECIAL = re.compile(r"<\|[a-z_]+\|>")  # <|im_end|>, <|endoftext|>: also dropped by decode
_NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")


# ---------------------------------------------------------------- answer extraction and checking


def strip_tags(text: str) -> str:
    """The response as `decode(skip_special_tokens=True)` shows it: tags and chat tokens removed."""
    return _CHAT_SPECIAL.sub("", TAG_PATTERN.sub("", text))


def extract_final_answer(text: str) -> str | None:
    """Content of the last `Final Answer:` line (case-insensitive), else None."""
    found = _FINAL_ANSWER.findall(text)
    return found[-1].strip() if found else None


# Minerva normalisation (Lewkowycz et al. 2022, as in lm-eval-harness and the official code).
_MINERVA_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_MINERVA_REMOVALS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
    "meters", "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}",
    "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
_MINERVA_REWRITES = (
    (r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$"),  # keep the first $...$ span
    (r"(\\text\{)(.*?)(\})", "\\2"),
    (r"(\\textbf\{)(.*?)(\})", "\\2"),
    (r"(\\overline\{)(.*?)(\})", "\\2"),
    (r"(\\boxed\{)(.*)(\})", "\\2"),
    (r"(frac)([^{])(.)", "frac{\\2}{\\3}"),  # \frac12 -> \frac{1}{2}
    (r"(sqrt)([^{])", "sqrt{\\2}"),  # \sqrt2 -> \sqrt{2}
)


def normalize_math_answer(answer: str) -> str:
    """Minerva normalisation: right side of `=`, units and TeX decoration removed, `1,000` -> `1000`."""
    answer = answer.split("=")[-1]
    for before, after in _MINERVA_SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for removed in _MINERVA_REMOVALS:
        answer = answer.replace(removed, "")
    for pattern, replacement in _MINERVA_REWRITES:
        answer = re.sub(pattern, replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def gsm8k_number(answer: str) -> Decimal | None:
    """First number in a final-answer line, `$` and `,` removed (`$1,000.50` -> 1000.50), else None."""
    match = _NUMBER.search(answer.replace("$", ""))
    if match is None:
        return None
    try:
        return Decimal(match.group().replace(",", ""))
    except InvalidOperation:
        return None


def _gsm8k_truth(ground_truth: str) -> Decimal:
    try:
        return Decimal(ground_truth.replace(",", "").replace("$", "").strip())
    except InvalidOperation:
        raise PipelineError(
            f"ground truth {ground_truth!r} is not a number (answer_kind 'gsm8k')"
        ) from None


def _math_verify_parse(text: str) -> list:
    """math_verify.parse, retried inside `$...$` for bare TeX such as `\\dfrac{1}{2}`."""
    from math_verify import parse

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    parsed = parse(text, parsing_timeout=timeout)
    return parsed or parse(f"${text}$", parsing_timeout=timeout)


def _math_verify_equal(answer: str, ground_truth: str) -> bool:
    from math_verify import verify

    gold, pred = _math_verify_parse(ground_truth), _math_verify_parse(answer)
    if not gold or not pred:
        return False
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    return bool(verify(gold, pred, timeout_seconds=timeout))


def is_correct(response: str, ground_truth: str, answer_kind: str, checker: str = "paper") -> bool:
    """Whether the response's last `Final Answer:` line matches the ground truth.

    `answer_kind` is "gsm8k" (numeric) or "math" (Minerva-normalised exact match);
    `checker` is "paper" (the authors' rules) or "math_verify". No final answer is wrong.
    """
    if answer_kind not in ANSWER_KINDS:
        raise PipelineError(f"answer_kind {answer_kind!r} is unknown; expected one of {ANSWER_KINDS}")
    if checker not in CHECKERS:
        raise PipelineError(f"checker {checker!r} is unknown; expected one of {CHECKERS}")
    text = strip_tags(response)
    if checker == "math_verify":
        answer = extract_final_answer(text)
        return answer is not None and _math_verify_equal(answer, ground_truth)
    if answer_kind == "math":
        answer = extract_final_answer(text[-MATH_WINDOW_CHARS:])
        return answer is not None and normalize_math_answer(answer) == normalize_math_answer(ground_truth)
    truth = _gsm8k_truth(ground_truth)
    answer = extract_final_answer(text)
    number = gsm8k_number(answer) if answer is not None else None
    return number is not None and number == truth


# ---------------------------------------------------------------- reward types and schedules

ACCURACY = "accuracy"
PARALLEL_TIMES_ACCURACY = "parallel_times_accuracy"
TIERED = "tiered"
PARALLEL_ONLY = "parallel_only"
PARALLEL_DIVERSITY = "parallel_diversity"
REWARD_TYPES = (ACCURACY, PARALLEL_TIMES_ACCURACY, TIERED, PARALLEL_ONLY, PARALLEL_DIVERSITY)


BONUS_NEEDS = ("tag", "well_formed")  # what earns parallel_diversity's bonus: official "tag"
SELF_BLEU_READS = ("any_block", "well_formed")  # whose blocks its self-BLEU reads: official "any_block"


@dataclass(frozen=True)
class RewardConfig:
    """Knobs of every reward and schedule (the stage reads SHARED_KNOBS and the schedule's SCHEDULE_KNOBS).

    Answer checking:
        checker: "paper" (the authors' extraction rules) or "math_verify".
        parallel_check: what counts as ">= 1 well-formed block" in the rewards: "authors" (the
            official reward code's check, `format.passes_authors_check`) or "algorithm1" (the
            paper's Algorithm 1, which the SFT filter and the evaluation's parallel ratio use).
    Reward values:
        correct_reward / incorrect_reward: accuracy-only +1 / -1; also the pass / fail values of
            parallel_times_accuracy (+1 only if correct AND >= 1 well-formed block) and
            parallel_only (+1 iff >= 1 well-formed block).
        tiered_parallel_reward: tiered reward for a correct answer with >= 1 well-formed block (1.2).
        tiered_correct_reward: tiered reward for a correct answer with no `<Parallel>` at all (1.0).
            A correct answer that holds `<Parallel>` but fails `parallel_check` (on the paper profile
            the authors' check of the whole response; Algorithm 1 under "algorithm1") gets
            incorrect_reward, as in the official S2 reward, `math_dapo_acc_parallel_interved.py`.
    Schedules (steps are 1-based steps, one rollout batch each, not optimizer updates):
        window: length of the alternating cycle (10).
        tiered_steps: steps per window that use the tiered reward, at the window's end (2):
            step s is tiered when (s - 1) mod window >= window - tiered_steps.
        switch_step: scaffold uses the alternating schedule for steps 1..switch_step, then
            accuracy-only (200).
    Diversity-aware parallel reward (beyond the paper's tables: the authors' released
    `math_dapo_accuracy_add_parallel_add_diversity.py`, reward_method
    `accuracy_add_parallel_add_diversity_reward`):
        correct_reward / incorrect_reward + parallel_bonus (1.0) if the response holds `<Parallel>`
        - self_bleu_weight (0.3) x `format.self_bleu` (mean pairwise sentence BLEU of each block's
        paths; 1.0 without a block).
        parallel_bonus_needs: "tag" (official: any `<Parallel>` earns the bonus, so an unclosed block
            gets it with the full self-BLEU penalty) or "well_formed" (a block passing
            `parallel_check`). On a 135M model at a large learning rate the official rule teaches
            blocks that are opened and never closed (docs/rl_small_profile.md), so the small profile
            sets "well_formed" (listed in docs/deviations.md).
        self_bleu_reads: "any_block" (official: every closed `<Parallel>…</Parallel>` span, well-formed
            or not) or "well_formed" (a response failing `parallel_check` is read as having no block,
            self-BLEU 1.0). With a "well_formed" bonus, "any_block" still pays for diverse paths in broken
            blocks (up to 0.3 over no block); on the small profile that route once took every held-out
            block out of format (docs/rl_small_profile.md, run E), so the small profile sets "well_formed"
            (listed in docs/deviations.md).
    """

    checker: str = "paper"
    parallel_check: Literal["authors", "algorithm1"] = "authors"  # format.is_parallel: rewards' check
    correct_reward: float = 1.0
    incorrect_reward: float = -1.0
    tiered_parallel_reward: float = 1.2
    tiered_correct_reward: float = 1.0
    window: int = field(default=10, metadata={"min": 1})
    tiered_steps: int = field(default=2, metadata={"min": 0})
    switch_step: int = field(default=200, metadata={"min": 0})
    parallel_bonus: float = 1.0
    self_bleu_weight: float = 0.3
    parallel_bonus_needs: Literal["tag", "well_formed"] = "tag"
    self_bleu_reads: Literal["any_block", "well_formed"] = "any_block"

    def __post_init__(self) -> None:
        check_fields(self)
        if self.checker not in CHECKERS:
            raise PipelineError(f"checker: {self.checker!r} is unknown; expected one of {CHECKERS}")
        if self.parallel_bonus_needs not in BONUS_NEEDS:
            raise PipelineError(f"parallel_bonus_needs: {self.parallel_bonus_needs!r} is unknown; "
                                f"expected one of {BONUS_NEEDS}")
        if self.self_bleu_reads not in SELF_BLEU_READS:
            raise PipelineError(f"self_bleu_reads: {self.self_bleu_reads!r} is unknown; "
                                f"expected one of {SELF_BLEU_READS}")
        if self.tiered_steps > self.window:
            raise PipelineError(f"tiered_steps: must be in [0, window={self.window}], "
                                f"got {self.tiered_steps}")


def _alternating(step: int, config: RewardConfig) -> str:
    in_window = (step - 1) % config.window
    return TIERED if in_window >= config.window - config.tiered_steps else ACCURACY


def _scaffold(step: int, config: RewardConfig) -> str:
    return _alternating(step, config) if step <= config.switch_step else ACCURACY


Schedule = Callable[[int, RewardConfig], str]

REWARDS: dict[str, Schedule] = {
    ACCURACY: lambda step, config: ACCURACY,  # DAPO RL, Unseen S1
    PARALLEL_TIMES_ACCURACY: lambda step, config: PARALLEL_TIMES_ACCURACY,  # GSM8K RL (stage 4)
    TIERED: lambda step, config: TIERED,
    PARALLEL_ONLY: lambda step, config: PARALLEL_ONLY,  # reward ablation
    PARALLEL_DIVERSITY: lambda step, config: PARALLEL_DIVERSITY,  # the authors' code, beyond the tables
    "alternating": _alternating,  # Unseen S2
    "scaffold": _scaffold,  # section 4.5
}
_STEP_FREE = set(REWARD_TYPES)

# Which RewardConfig fields a schedule reads. Every schedule reads SHARED_KNOBS; SCHEDULE_KNOBS[name] are
# read only by schedule `name`, so the stage takes them from its own entry (params.yaml
# `reward_schedules.<name>`) and DVC retrains only the runs on a schedule whose knobs changed.
SHARED_KNOBS = ("checker", "parallel_check", "correct_reward", "incorrect_reward")
_TIERED_KNOBS = ("tiered_parallel_reward", "tiered_correct_reward")
SCHEDULE_KNOBS: dict[str, tuple[str, ...]] = {
    ACCURACY: (),
    PARALLEL_TIMES_ACCURACY: (),
    TIERED: _TIERED_KNOBS,
    PARALLEL_ONLY: (),
    PARALLEL_DIVERSITY: ("parallel_bonus", "self_bleu_weight", "parallel_bonus_needs", "self_bleu_reads"),
    "alternating": (*_TIERED_KNOBS, "window", "tiered_steps"),
    "scaffold": (*_TIERED_KNOBS, "window", "tiered_steps", "switch_step"),
}


def _schedule(name: str) -> Schedule:
    if name not in REWARDS:
        raise PipelineError(f"reward {name!r} is unknown; known rewards are {sorted(REWARDS)}")
    return REWARDS[name]


def reward_type_at(name: str, step: int, config: RewardConfig | None = None) -> str:
    """Reward type (one of REWARD_TYPES) that schedule `name` uses at 1-based `step` (a rollout batch)."""
    return _schedule(name)(step, config or RewardConfig())


def score(reward_type: str, correct: bool, parallel: bool, attempted: bool, config: RewardConfig,
          paths_self_bleu: float = 1.0) -> float:
    """Reward of one response: `parallel` = >= 1 well-formed block, `attempted` = any `<Parallel>`,
    `paths_self_bleu` = `format.self_bleu` of the response, or NO_BLOCK_SELF_BLEU where
    `RewardConfig.self_bleu_reads` does not read it (read by parallel_diversity only)."""
    win, lose = config.correct_reward, config.incorrect_reward
    if reward_type == PARALLEL_DIVERSITY:
        earned = parallel if config.parallel_bonus_needs == "well_formed" else attempted
        bonus = config.parallel_bonus if earned else 0.0
        return (win if correct else lose) + bonus - config.self_bleu_weight * paths_self_bleu
    if reward_type == ACCURACY:
        return win if correct else lose
    if reward_type == PARALLEL_TIMES_ACCURACY:
        return win if correct and parallel else lose
    if reward_type == PARALLEL_ONLY:
        return win if parallel else lose
    if reward_type == TIERED:
        if correct and parallel:
            return config.tiered_parallel_reward
        return config.tiered_correct_reward if correct and not attempted else lose
    raise PipelineError(f"reward type {reward_type!r} is unknown; expected one of {REWARD_TYPES}")


# ---------------------------------------------------------------- TRL reward functions


def completion_texts(completions: list, completion_text: list[str] | None = None) -> list[str]:
    """Raw response texts: `completion_text` (tags kept) when given, else the TRL completions.

    A TRL completion is a string or a list of chat messages; assistant contents are joined.
    """
    if completion_text is not None:
        if len(completion_text) != len(completions):
            raise PipelineError(
                f"reward kwargs: completion_text has {len(completion_text)} items "
                f"for {len(completions)} completions"
            )
        return list(completion_text)
    texts = []
    for completion in completions:
        if isinstance(completion, str):
            texts.append(completion)
            continue
        parts = []
        for message in completion:
            if message.get("role", "assistant") != "assistant":
                continue
            content = message.get("content") or ""
            if isinstance(content, list):  # multimodal form: [{"type": "text", "text": ...}]
                content = "".join(part.get("text", "") for part in content)
            parts.append(content)
        texts.append("".join(parts))
    return texts


def _column(kwargs: Mapping[str, Any], key: str, size: int, reward: str) -> list:
    values = kwargs.get(key)
    if values is None:
        raise PipelineError(f"reward {reward!r}: dataset column {key!r} is missing from the reward kwargs")
    if len(values) != size:
        raise PipelineError(
            f"reward {reward!r}: column {key!r} has {len(values)} values for {size} completions"
        )
    return list(values)


class RewardFunction:
    """A named reward schedule as a TRL reward function (picklable; `__name__` is the schedule name)."""

    def __init__(self, name: str, config: RewardConfig, updates_per_step: int = 1) -> None:
        _schedule(name)  # fail early on an unknown name
        if updates_per_step < 1:
            raise PipelineError(f"reward {name!r}: updates_per_step must be >= 1, got {updates_per_step}")
        self.name = self.__name__ = name
        self.config = config
        self.updates_per_step = updates_per_step

    def step_of(self, trainer_state) -> int:
        """1-based step (rollout batch) being generated for, from TRL's `global_step` (optimizer updates)."""
        if trainer_state is None:
            if self.name in _STEP_FREE:
                return 1
            raise PipelineError(f"reward {self.name!r} follows the training step but got no trainer_state")
        return int(trainer_state.global_step) // self.updates_per_step + 1

    def __call__(self, prompts, completions, completion_ids=None, **kwargs) -> list[float]:
        texts = completion_texts(completions, kwargs.get("completion_text"))
        truths = _column(kwargs, "ground_truth", len(texts), self.name)
        kinds = _column(kwargs, "answer_kind", len(texts), self.name)
        reward_type = reward_type_at(self.name, self.step_of(kwargs.get("trainer_state")), self.config)
        correct = [is_correct(t, g, k, self.config.checker)
                   for t, g, k in zip(texts, truths, kinds, strict=True)]
        parallel = [is_parallel(t, self.config.parallel_check) for t in texts]
        diverse = reward_type == PARALLEL_DIVERSITY
        read = [diverse and (p or self.config.self_bleu_reads == "any_block") for p in parallel]
        bleus = [self_bleu(t) if r else NO_BLOCK_SELF_BLEU  # sacrebleu only where it is read
                 for t, r in zip(texts, read, strict=True)]
        rewards = [
            score(reward_type, c, p, PARALLEL_OPEN in t, self.config, b)
            for t, c, p, b in zip(texts, correct, parallel, bleus, strict=True)
        ]
        log_metric = kwargs.get("log_metric")
        if log_metric is not None and texts:
            log_metric("accuracy", sum(correct) / len(texts))
            log_metric("parallel_ratio", sum(parallel) / len(texts))
            log_metric("reward_type_tiered", float(reward_type == TIERED))
            if diverse:
                log_metric("self_bleu", sum(bleus) / len(bleus))
        return rewards

    def __repr__(self) -> str:
        return f"RewardFunction({self.name!r}, {self.config!r})"


def build_reward(name: str, config: RewardConfig | None = None, updates_per_step: int = 1) -> RewardFunction:
    """The TRL reward function for registry name `name` (see REWARDS); `updates_per_step` optimizer
    updates make one step of its schedule."""
    return RewardFunction(name, config or RewardConfig(), updates_per_step)
