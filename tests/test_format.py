"""Algorithm 1 (the parallel-thinking format check), block parsing and parallel metrics."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel_r1 import format as fmt
from parallel_r1.filtering import FilterConfig, filter_outputs
from parallel_r1.format import check_format, count_blocks, parallel_position, parallel_ratio, parse_blocks

BLOCK = "<Parallel><Path>a</Path><Path>b</Path></Parallel><Summary>s</Summary>"


@pytest.mark.parametrize("text", [
    "x " + BLOCK + " y\nFinal Answer: 3",
    BLOCK + BLOCK,
    "<Parallel>\n<Path>a</Path>\n<Path>b</Path>\n<Path>c</Path>\n</Parallel>\n<Summary>s</Summary>",
    "<Parallel><Path></Path><Path></Path></Parallel>  <Summary></Summary>",
])
def test_well_formed_responses_pass(text):
    assert check_format(text).ok


@pytest.mark.parametrize("text, reason", [
    ("<Parallel><Path>a</Path><Path>b</Path></Summary>", fmt.UNEXPECTED_CLOSE),
    ("<Parallel><Path>a</Parallel>", fmt.UNEXPECTED_CLOSE),
    ("</Path>" + BLOCK, fmt.UNEXPECTED_CLOSE),
    ("<Path>a</Path>" + BLOCK, fmt.WRONG_NESTING),
    ("<Parallel><Path>a<Parallel></Parallel></Path></Parallel>", fmt.WRONG_NESTING),
    ("<Parallel><Path>a</Path><Summary>s</Summary></Parallel>", fmt.WRONG_NESTING),
    ("<Parallel><Path>a<Path>b</Path></Path></Parallel>", fmt.WRONG_NESTING),
    ("<Parallel><Path>a</Path></Parallel><Summary>s</Summary>", fmt.TOO_FEW_PATHS),
    ("<Parallel></Parallel><Summary>s</Summary>", fmt.TOO_FEW_PATHS),
    ("<Summary>s</Summary>", fmt.SUMMARY_WITHOUT_BLOCK),
    (BLOCK + "<Summary>again</Summary>", fmt.SUMMARY_WITHOUT_BLOCK),
    ("<Parallel><Path>a</Path><Path>b</Path></Parallel> no summary", fmt.BLOCK_WITHOUT_SUMMARY),
    ("<Parallel><Path>a</Path><Path>b</Path></Parallel>" + BLOCK, fmt.BLOCK_WITHOUT_SUMMARY),
    ("<Parallel><Path>a</Path><Path>b", fmt.UNCLOSED_TAG),
    (BLOCK + "<Parallel><Path>a</Path>", fmt.UNCLOSED_TAG),
    ("plain reasoning\nFinal Answer: 4", fmt.NO_PARALLEL_BLOCK),
    ("", fmt.NO_PARALLEL_BLOCK),
])
def test_each_rejection_rule(text, reason):
    result = check_format(text)
    assert not result.ok
    assert result.reason == reason


def test_no_block_is_valid_when_blocks_are_not_required():
    assert check_format("plain text", require_block=False).ok


def test_rejection_detail_says_where():
    text = "ok <Summary>x</Summary>"
    assert check_format(text).detail == f"<Summary> at character {text.index('<Summary>')}"


def test_real_teacher_outputs(mirror):
    with open(mirror / "teacher_demos_gsm8k.jsonl") as source:
        rows = [json.loads(line) for line in source]
    results = [check_format(r["completion"]) for r in rows]
    valid = sum(r.ok for r in results)
    assert len(rows) == 300
    # The released cold-start data was already filtered by the authors: nearly all pass, and the
    # few that fail hold no block at all (they answered without parallel thinking).
    assert valid >= 290
    assert {r.reason for r in results if not r.ok} <= {fmt.NO_PARALLEL_BLOCK}
    assert all(count_blocks(r["completion"]) >= 1 for r, res in zip(rows, results, strict=False) if res.ok)


def test_rollout_layout_drops_only_the_whitespace_between_a_blocks_tags(mirror):
    with open(mirror / "teacher_demos_gsm8k.jsonl") as source:
        rows = [json.loads(line) for line in source]
    demos = [r["completion"] for r in rows if check_format(r["completion"]).ok]
    assert any("<Parallel>\n<Path>" in d for d in demos)  # the released layout: a newline between tags
    for demo in demos:
        laid_out = fmt.rollout_layout(demo)
        assert fmt.rollout_layout(laid_out) == laid_out
        assert check_format(laid_out).ok and count_blocks(laid_out) == count_blocks(demo)
        assert not re.search(r"(<Parallel>|</Path>)\s+(<Path>|</Parallel>)", laid_out)
        assert laid_out.count("</Parallel>\n<Summary>") == len(re.findall(r"</Parallel>\s*<Summary>", demo))
        # the text outside the tags is the demo's: the paths and summaries, and the main text around them
        assert fmt.TAG_PATTERN.sub(" ", laid_out).split() == fmt.TAG_PATTERN.sub(" ", demo).split()
        assert [laid_out[p.start:p.end] for b in parse_blocks(laid_out) for p in b.paths] == \
            [demo[p.start:p.end] for b in parse_blocks(demo) for p in b.paths]
    assert fmt.rollout_layout("a\n<Parallel>\n <Path>x</Path>\n\n<Path>y</Path>\n</Parallel><Summary>s"
                              "</Summary>\n\nb") == \
        "a\n<Parallel><Path>x</Path><Path>y</Path></Parallel>\n<Summary>s</Summary>\n\nb"


def test_filter_writes_kept_demos_in_the_rollout_layout_unless_told_not_to():
    demo = ("Think.\n\n<Parallel>\n<Path>a</Path>\n<Path>b</Path>\n</Parallel>\n<Summary>s</Summary>\n\n"
            "Final Answer: 3")
    rows = [{"id": "1", "completion": demo, "completion_tokens": 40}]
    laid_out = filter_outputs(rows, FilterConfig()).kept
    assert (laid_out == [{**rows[0], "completion": fmt.rollout_layout(demo)}]
            and laid_out[0]["completion"] != demo)
    assert filter_outputs(rows, FilterConfig(rollout_layout=False)).kept == rows
    assert rows[0]["completion"] == demo  # the teacher's rows are not modified in place


def test_parse_blocks_spans():
    text = "pre " + BLOCK + " mid " + BLOCK
    blocks = parse_blocks(text)
    assert len(blocks) == 2
    first = blocks[0]
    assert (text[first.parallel.start:first.parallel.end]
            == "<Parallel><Path>a</Path><Path>b</Path></Parallel>")
    assert [text[p.start:p.end] for p in first.paths] == ["<Path>a</Path>", "<Path>b</Path>"]
    assert text[first.summary.start:first.summary.end] == "<Summary>s</Summary>"
    assert parse_blocks("<Parallel><Path>a") == []


def test_parallel_ratio_and_position():
    assert parallel_ratio(["x" + BLOCK, "no block", BLOCK, "<Parallel>broken"]) == 0.5
    assert parallel_ratio([]) == 0.0
    text = "abcd" + BLOCK
    assert parallel_position(text) == pytest.approx(4 / len(text))
    assert parallel_position("no block") is None


class _CharTokenizer:
    """One token per character: token-level position equals character-level position."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(range(len(text)))}


def test_parallel_position_token_level():
    text = "abcd" + BLOCK
    assert parallel_position(text, _CharTokenizer()) == pytest.approx(parallel_position(text))


words = st.text(alphabet="abc xyz0123456789\n", max_size=12)


@st.composite
def well_formed_responses(draw):
    parts = [draw(words)]
    for _ in range(draw(st.integers(1, 3))):
        paths = "".join(f"<Path>{draw(words)}</Path>" for _ in range(draw(st.integers(2, 4))))
        parts.append(f"<Parallel>{draw(words)}{paths}</Parallel>{draw(st.sampled_from(['', ' ', chr(10)]))}"
                     f"<Summary>{draw(words)}</Summary>{draw(words)}")
    return "".join(parts)


@settings(max_examples=200, deadline=None)
@given(well_formed_responses())
def test_generated_well_formed_blocks_pass(text):
    assert check_format(text).ok
    assert count_blocks(text) == text.count("<Parallel>")


@settings(max_examples=300, deadline=None)
@given(well_formed_responses(), st.data())
def test_deleting_any_single_tag_fails(text, data):
    tags = list(fmt.TAG_PATTERN.finditer(text))
    victim = data.draw(st.sampled_from(tags))
    corrupted = text[:victim.start()] + text[victim.end():]
    assert not check_format(corrupted).ok


@settings(max_examples=300, deadline=None)
@given(well_formed_responses(), st.sampled_from(fmt.TAGS), st.data())
def test_inserting_any_single_tag_fails(text, tag, data):
    inside_a_tag = {i for m in fmt.TAG_PATTERN.finditer(text) for i in range(m.start() + 1, m.end())}
    position = data.draw(st.sampled_from([i for i in range(len(text) + 1) if i not in inside_a_tag]))
    assert not check_format(text[:position] + tag + text[position:]).ok


def test_path_diversity_is_zero_for_copies_and_one_for_disjoint_paths():
    from parallel_r1.format import path_diversity

    copies = "a <Parallel><Path>x = 2 + 3</Path><Path>x = 2 + 3</Path></Parallel><Summary>5</Summary> b"
    disjoint = ("<Parallel><Path>add two and three</Path><Path>5 by counting</Path></Parallel>"
                "<Summary>5</Summary>")
    assert path_diversity(copies) == 0.0
    assert path_diversity(disjoint) == 1.0
    assert path_diversity("no block here") is None
    # two blocks: the mean of their diversities
    assert path_diversity(copies + " " + disjoint) == 0.5


def test_path_diversity_of_three_paths_is_the_mean_over_pairs():
    from parallel_r1.format import path_diversity

    text = "<Parallel><Path>a b</Path><Path>a b</Path><Path>c d</Path></Parallel><Summary>s</Summary>"
    assert path_diversity(text) == pytest.approx(1 - (1 + 0 + 0) / 3)
