"""The parallel-thinking format: tags, Algorithm 1, block parsing and parallel metrics.

A response alternates ordinary reasoning with blocks of the form

    <Parallel><Path>...</Path><Path>...</Path></Parallel><Summary>...</Summary>

`check_format` is the paper's Algorithm 1 ("Parallel Thinking Format Check"): a stack
over the tags that rejects mismatched, wrongly nested or unclosed tags, a block with
fewer than two completed paths, and a block without its summary. It says nothing about
mathematical correctness. A response must hold at least one block to count as
parallel-format (otherwise DAPO's 0.0% of Table 1 would be ~100%: the teacher simply
writes no blocks there).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PARALLEL_OPEN, PARALLEL_CLOSE = "<Parallel>", "</Parallel>"
PATH_OPEN, PATH_CLOSE = "<Path>", "</Path>"
SUMMARY_OPEN, SUMMARY_CLOSE = "<Summary>", "</Summary>"
TAGS = (PARALLEL_OPEN, PARALLEL_CLOSE, PATH_OPEN, PATH_CLOSE, SUMMARY_OPEN, SUMMARY_CLOSE)
TAG_PATTERN = re.compile(r"</?(?:Parallel|Path|Summary)>")
_CLOSES = {PARALLEL_CLOSE: PARALLEL_OPEN, PATH_CLOSE: PATH_OPEN, SUMMARY_CLOSE: SUMMARY_OPEN}

# What the rollout engine (engine/loop.py, as the official loop) writes between a block's tags: nothing
# between `<Parallel>`, the paths and `</Parallel>`, and this between `</Parallel>` and `<Summary>`.
SUMMARY_SEPARATOR = "\n"
_GAP_BEFORE_PATH = re.compile(r"(<Parallel>|</Path>)\s+(?=<Path>|</Parallel>)")
_GAP_BEFORE_SUMMARY = re.compile(r"</Parallel>\s*<Summary>")

# Rejection reasons, counted by the filter stage.
UNEXPECTED_CLOSE = "unexpected_closing_tag"
WRONG_NESTING = "wrong_nesting"
TOO_FEW_PATHS = "too_few_paths"
SUMMARY_WITHOUT_BLOCK = "summary_without_block"
BLOCK_WITHOUT_SUMMARY = "block_without_summary"
UNCLOSED_TAG = "unclosed_tag"
NO_PARALLEL_BLOCK = "no_parallel_block"


@dataclass(frozen=True)
class FormatResult:
    """Outcome of Algorithm 1: `ok`, else the first rule broken and where (character offset)."""

    ok: bool
    reason: str | None = None
    detail: str = ""

    def __bool__(self) -> bool:
        return self.ok


def _reject(reason: str, tag: str, pos: int) -> FormatResult:
    return FormatResult(False, reason, f"{tag} at character {pos}")


def check_format(text: str, require_block: bool = True) -> FormatResult:
    """Algorithm 1: stack-based check of the parallel tags in `text`.

    Rules, in the order they are met while scanning the tags left to right:
    a closing tag must match the top of the stack; `<Path>` may only open directly
    inside `<Parallel>`, `<Parallel>` and `<Summary>` only at top level, and nothing
    opens inside a `<Path>` or `<Summary>`; `</Parallel>` needs >= 2 completed paths;
    each `</Parallel>` must be followed by a `<Summary>` before the next block
    (#<Summary> = #</Parallel>); nothing may be left open.
    """
    stack: list[str] = []
    paths_in_block = 0
    blocks = 0
    summary_expected = False
    for match in TAG_PATTERN.finditer(text):
        tag, pos = match.group(), match.start()
        if tag in _CLOSES:
            if not stack or stack[-1] != _CLOSES[tag]:
                return _reject(UNEXPECTED_CLOSE, tag, pos)
            stack.pop()
            if tag == PATH_CLOSE:
                paths_in_block += 1
            elif tag == PARALLEL_CLOSE:
                if paths_in_block < 2:
                    return _reject(TOO_FEW_PATHS, tag, pos)
                blocks += 1
                summary_expected = True
            continue
        parent = stack[-1] if stack else None
        if tag == PATH_OPEN and parent != PARALLEL_OPEN:
            return _reject(WRONG_NESTING, tag, pos)
        if tag in (PARALLEL_OPEN, SUMMARY_OPEN) and parent is not None:
            return _reject(WRONG_NESTING, tag, pos)
        if tag == PARALLEL_OPEN:
            if summary_expected:
                return _reject(BLOCK_WITHOUT_SUMMARY, tag, pos)
            paths_in_block = 0
        if tag == SUMMARY_OPEN:
            if not summary_expected:
                return _reject(SUMMARY_WITHOUT_BLOCK, tag, pos)
            summary_expected = False
        stack.append(tag)
    if stack:
        return FormatResult(False, UNCLOSED_TAG, f"{stack[-1]} never closed")
    if summary_expected:
        return FormatResult(False, BLOCK_WITHOUT_SUMMARY, "last </Parallel> has no <Summary>")
    if require_block and blocks == 0:
        return FormatResult(False, NO_PARALLEL_BLOCK, "no <Parallel> block")
    return FormatResult(True)


@dataclass(frozen=True)
class Span:
    """Half-open character span [start, end) of a tagged region, tags included."""

    start: int
    end: int


@dataclass(frozen=True)
class ParallelBlock:
    """One well-formed block: the `<Parallel>...</Parallel>` span, its paths and its summary."""

    parallel: Span
    paths: tuple[Span, ...]
    summary: Span | None = None


def parse_blocks(text: str) -> list[ParallelBlock]:
    """Blocks of `text` in order, for text that passes Algorithm 1 (else an empty list).

    Spans index characters of `text`; each path and summary span includes its tags.
    """
    if not check_format(text, require_block=False):
        return []
    blocks: list[ParallelBlock] = []
    block_start = path_start = summary_start = 0
    paths: list[Span] = []
    for match in TAG_PATTERN.finditer(text):
        tag, start, end = match.group(), match.start(), match.end()
        if tag == PARALLEL_OPEN:
            block_start, paths = start, []
        elif tag == PATH_OPEN:
            path_start = start
        elif tag == PATH_CLOSE:
            paths.append(Span(path_start, end))
        elif tag == PARALLEL_CLOSE:
            blocks.append(ParallelBlock(Span(block_start, end), tuple(paths)))
        elif tag == SUMMARY_OPEN:
            summary_start = start
        elif tag == SUMMARY_CLOSE:
            last = blocks[-1]
            blocks[-1] = ParallelBlock(last.parallel, last.paths, Span(summary_start, end))
    return blocks


def rollout_layout(text: str) -> str:
    """`text` with each block's tags laid out as the rollout engine inserts them.

    The engine forks at `<Parallel>` and writes `<Path>` itself, right after `<Parallel>` and after
    the previous `</Path>`, then `</Parallel>`, SUMMARY_SEPARATOR and `<Summary>` (the official
    loop's layout). Teacher demos put newlines between these tags instead; a model trained on them
    expects a newline where the engine has already written `<Path>` and answers it with a second
    `<Path>` (wrong nesting). Only the whitespace between those tags changes: the reasoning, the
    paths' and the summary's text, and the Algorithm 1 verdict stay as they were.
    """
    text = _GAP_BEFORE_PATH.sub(r"\1", text)
    return _GAP_BEFORE_SUMMARY.sub(PARALLEL_CLOSE + SUMMARY_SEPARATOR + SUMMARY_OPEN, text)


def is_parallel(text: str, check: str = "algorithm1") -> bool:
    """True when the response holds at least one well-formed block: by Algorithm 1 (`check_format`),
    or with `check="authors"` by the official reward code's looser check (`passes_authors_check`)."""
    if check == "authors":
        return PARALLEL_OPEN in text and passes_authors_check(text)
    return check_format(text).ok


def passes_authors_check(text: str) -> bool:
    """The parallel-format check of the official reward functions (`check_parallel_thinking_format` in
    the released `verl/utils/reward_score/*.py`; the RL rewards count a response as parallel when it
    has a `<Parallel>` and passes it), re-stated: closing `</Path>` / `</Parallel>` must match the
    innermost open tag; a `</Parallel>` needs >= 2 paths closed inside it; a `<Summary>` must come
    after a `</Parallel>` (a new `<Parallel>` cancels the wait); nothing left open, no summary left
    owed, and #`<Summary>` = #`</Parallel>`. Looser than Algorithm 1: `</Summary>` is never checked
    (a stray or missing one passes), a `<Path>` need not sit directly inside `<Parallel>`, blocks may
    nest, and text may follow a block before its summary.
    """
    stack: list[str] = []
    paths: list[int] = []  # paths closed in each open <Parallel>, innermost last
    summary_expected = False
    summaries = closes = 0
    for match in TAG_PATTERN.finditer(text):
        tag = match.group()
        if tag == PARALLEL_OPEN:
            stack.append(tag)
            paths.append(0)
            summary_expected = False
        elif tag == PATH_OPEN:
            stack.append(tag)
        elif tag == PATH_CLOSE:
            if not stack or stack[-1] != PATH_OPEN:
                return False
            stack.pop()
            if paths:
                paths[-1] += 1
        elif tag == PARALLEL_CLOSE:
            closes += 1
            if not stack or stack[-1] != PARALLEL_OPEN or paths.pop() < 2:
                return False
            stack.pop()
            summary_expected = True
        elif tag == SUMMARY_OPEN:
            if not summary_expected:
                return False
            summary_expected = False
            summaries += 1
    return not stack and not summary_expected and summaries == closes


def parallel_ratio(texts: list[str]) -> float:
    """Share of responses with at least one well-formed parallel block (0.0 for no responses)."""
    return sum(is_parallel(t) for t in texts) / len(texts) if texts else 0.0


def parallel_position(text: str, tokenizer=None) -> float | None:
    """Relative position of the first `<Parallel>`: start index / response length.

    Character-level by default; token-level when a tokenizer is given (the paper's
    Figure 3 uses tokens). None when the response has no `<Parallel>`.
    """
    start = text.find(PARALLEL_OPEN)
    if start < 0 or not text:
        return None
    if tokenizer is None:
        return start / len(text)
    before = len(tokenizer(text[:start], add_special_tokens=False)["input_ids"])
    total = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return before / total if total else None


def _path_words(text: str, span: Span) -> list[str]:
    """A path's words with its own tags stripped (the tags are identical in every path)."""
    return text[span.start + len(PATH_OPEN):span.end - len(PATH_CLOSE)].split()


def block_diversity(text: str, block: ParallelBlock) -> float:
    """1 - mean pairwise similarity of a block's paths (word level, difflib's matching ratio).

    0 = the paths are copies of each other, 1 = they share no word sequence. Beyond the paper:
    DPT (a follow-up on Parallel-R1) reports that RL collapses paths into near-copies, which the
    parallel ratio alone cannot show.
    """
    from difflib import SequenceMatcher
    from itertools import combinations

    words = [_path_words(text, span) for span in block.paths]
    pairs = [SequenceMatcher(None, a, b, autojunk=False).ratio() for a, b in combinations(words, 2)]
    return 1.0 - sum(pairs) / len(pairs) if pairs else 0.0


def path_diversity(text: str) -> float | None:
    """Mean `block_diversity` over the response's well-formed blocks; None when it has none."""
    blocks = parse_blocks(text)
    return sum(block_diversity(text, b) for b in blocks) / len(blocks) if blocks else None


# The official diversity reward's self-BLEU (`math_dapo_accuracy_add_parallel_add_diversity.py` in the
# authors' VERL fork) reads blocks and paths with these non-greedy regexes, not with Algorithm 1: a block
# missing its summary still counts, an unclosed one does not.
_BLOCK_TEXT = re.compile(r"<Parallel>(.*?)</Parallel>", flags=re.S)
_PATH_TEXT = re.compile(r"<Path>(.*?)</Path>", flags=re.S)
NO_BLOCK_SELF_BLEU = 1.0  # official: no block, or a block with < 2 paths, is "fully homogeneous"


def paths_self_bleu(paths: list[str]) -> float:
    """Mean pairwise sentence BLEU of `paths` in [0, 1]: sacrebleu's `sentence_bleu(p, [q])` (13a tokens,
    exp smoothing) / 100 over each unordered pair (p before q), as the official reward computes it.

    1 = copies, 0 = no shared n-gram; fewer than two paths give NO_BLOCK_SELF_BLEU.
    """
    if len(paths) < 2:
        return NO_BLOCK_SELF_BLEU
    from itertools import combinations

    import sacrebleu  # imported here: the modules that only read the format do not load it

    scores = [sacrebleu.sentence_bleu(p, [q]).score / 100.0 for p, q in combinations(paths, 2)]
    return sum(scores) / len(scores)


def self_bleu(text: str) -> float:
    """Mean `paths_self_bleu` over the `<Parallel>...</Parallel>` spans of `text` (tags kept), as the
    official diversity reward reads them; NO_BLOCK_SELF_BLEU when there is none."""
    blocks = _BLOCK_TEXT.findall(text)
    if not blocks:
        return NO_BLOCK_SELF_BLEU
    return sum(paths_self_bleu(_PATH_TEXT.findall(block)) for block in blocks) / len(blocks)


def count_blocks(text: str) -> int:
    """Number of well-formed blocks (0 when the text fails Algorithm 1)."""
    return len(parse_blocks(text))


@dataclass
class FormatStats:
    """Counts of format outcomes over a dataset, for the filter metrics and Table 1."""

    examples: int = 0
    valid: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def add(self, result: FormatResult) -> None:
        self.examples += 1
        if result.ok:
            self.valid += 1
        else:
            reason = str(result.reason)  # a failed check always names its reason
            self.reasons[reason] = self.reasons.get(reason, 0) + 1

    @property
    def valid_pct(self) -> float:
        return 100.0 * self.valid / self.examples if self.examples else 0.0
