"""The paper profile against the paper and the official recipe: every value checked, every difference named.

docs/deviations.md is the one list of where the paper profile follows the official VERL recipe and where it
deliberately differs; each of its rows that names a param is checked against the composed paper profile here,
and the paper's own numbers (paper_results.yaml `hyperparameters`) against the same profile. Also the pieces
that make the official behaviour: the scaffold switch, the authors' parallel check, the broken-block metric.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from parallel_r1.format import check_format, is_parallel
from parallel_r1.prompts import render_prompt
from parallel_r1.structure import build_structure
from parallel_r1.training.grpo_trainer import ScaffoldSwitch, completion_broken_blocks, reset_optimizer_state
from stages.profiles import compose

REPO = Path(__file__).resolve().parents[1]
DEVIATIONS = REPO / "docs" / "deviations.md"


@pytest.fixture(scope="module")
def paper() -> dict:
    return compose(REPO, "paper")


def value_at(params: dict, dotted: str):
    node = params
    for key in dotted.split("."):
        assert isinstance(node, dict) and key in node, f"paper profile has no {dotted}"
        node = node[key]
    return node


def table_rows(markdown: str) -> list[list[str]]:
    """Cells of every data row of the markdown tables (header and rule rows skipped)."""
    rows = []
    for line in markdown.splitlines():
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] in ("param", "what"):
            continue
        rows.append(cells)
    return rows


def param_cells(markdown: str) -> list[tuple[str, str]]:
    """(param, value) of each row: the first two backticked cells that name a dotted key and a value."""
    found = []
    for cells in table_rows(markdown):
        keys = [i for i, cell in enumerate(cells) if re.fullmatch(r"`[a-z_]+(\.[a-z_0-9]+)+`", cell)]
        if keys:
            index = keys[0]
            found.append((cells[index].strip("`"), cells[index + 1].strip("`")))
    return found


SMALL_SECTION = "## Where the small profile changes a rule"


def test_every_param_the_deviation_table_names_has_its_value_in_the_paper_profile(paper):
    pairs = param_cells(DEVIATIONS.read_text().split(SMALL_SECTION, 1)[0])
    assert len(pairs) >= 20
    for key, value in pairs:
        assert value_at(paper, key) == yaml.safe_load(value), f"docs/deviations.md: {key} = {value}"


def test_the_small_profiles_rule_changes_are_listed_with_their_values():
    small = compose(REPO, "small")
    pairs = param_cells(DEVIATIONS.read_text().split(SMALL_SECTION, 1)[1])
    assert ("reward_schedules.parallel_diversity.parallel_bonus_needs", "well_formed") in pairs
    assert ("reward_schedules.parallel_diversity.self_bleu_reads", "well_formed") in pairs
    for key, value in pairs:
        assert value_at(small, key) == yaml.safe_load(value), f"docs/deviations.md (small): {key} = {value}"


def test_every_deviation_row_says_what_the_official_recipe_does_and_why():
    text = DEVIATIONS.read_text()
    deviations = table_rows(text.split("## Where it deliberately differs", 1)[1])
    assert len(deviations) >= 7
    for what, official, here, param, value, why in deviations:
        assert official and here and len(why) > 40, what
        assert (param == "—") == (value == "—"), what


def test_paper_profile_holds_the_papers_hyperparameters(paper):
    hp = yaml.safe_load((REPO / "parallel_r1" / "paper_results.yaml").read_text())["hyperparameters"]
    sft, rl = paper["sft"], paper["rl"]
    assert (sft["batch_size"], sft["lr"], sft["weight_decay"], sft["warmup_ratio"], sft["lr_scheduler"]) == (
        hp["sft"]["batch_size"], hp["sft"]["lr"], hp["sft"]["weight_decay"], hp["sft"]["warmup_ratio"],
        hp["sft"]["schedule"])
    assert paper["sft_variants"]["seen"]["max_steps"] == hp["sft"]["grad_updates_seen"]
    assert paper["sft_variants"]["unseen"]["max_steps"] == hp["sft"]["grad_updates_unseen"]
    for dataset, section in (("gsm8k", "rl_gsm8k"), ("dapo", "rl_dapo")):
        own = paper["rl_datasets"][dataset]
        assert (own["batch_size"], own["num_generations"], own["max_steps"]) == (
            hp[section]["batch_size"], hp[section]["rollouts"], hp[section]["grad_updates"])
        assert rl["lr"] == hp[section]["lr"]
    assert (rl["warmup_ratio"], rl["lr_scheduler"], rl["beta"], rl["epsilon"]) == (0.0, "constant", 0.0, 0.2)
    s2 = paper["reward_schedules"]["alternating"]
    assert s2["window"] == hp["s2_alternating"]["window_steps"]
    assert 1 - s2["tiered_steps"] / s2["window"] == pytest.approx(hp["s2_alternating"]["accuracy_share"])
    tiered = hp["s2_alternating"]["tiered_reward"]
    ours = (s2["tiered_parallel_reward"], s2["tiered_correct_reward"], paper["rewards"]["incorrect_reward"])
    assert ours == (tiered["correct_with_parallel"], tiered["correct_without_parallel"], tiered["otherwise"])
    assert paper["rewards"]["correct_reward"] == hp["gsm8k_rl_reward"]["correct_and_parallel"]
    scaffold = yaml.safe_load((REPO / "parallel_r1" / "paper_results.yaml").read_text())["scaffold"]
    assert paper["reward_schedules"]["scaffold"]["switch_step"] == scaffold["switch_step"]
    evaluation = paper["evaluate"]
    assert evaluation["temperature"] == hp["eval"]["temperature"]
    assert evaluation["benchmarks"]["math"]["k"] == hp["eval"]["math_samples"]
    assert {evaluation["benchmarks"][name]["k"] for name in ("aime24", "aime25", "amc23")} == {
        hp["eval"]["other_samples"]}


# ---------------------------------------------------------------------------------- scaffold switch


def adam_after_steps(model: torch.nn.Module, steps: int) -> torch.optim.AdamW:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    for step in range(steps):
        optimizer.zero_grad()
        model(torch.full((1, 3), float(step + 1))).pow(2).sum().backward()
        optimizer.step()
    return optimizer


def test_scaffold_switch_restarts_the_optimizer_and_drops_clip_high():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = adam_after_steps(model, 3)
    trainer = SimpleNamespace(optimizer=SimpleNamespace(optimizer=optimizer), epsilon_high=0.28)  # a wrapper
    switch = ScaffoldSwitch(switch_step=2, epsilon=0.2, updates_per_step=2)  # step 2 = update 4
    switch.trainer = trainer
    switch.on_step_end(None, SimpleNamespace(global_step=3), None)
    assert trainer.epsilon_high == 0.28 and switch.switched_at is None  # not yet
    switch.on_step_end(None, SimpleNamespace(global_step=4), None)
    assert trainer.epsilon_high == 0.2 and switch.switched_at == 4

    fresh_model = torch.nn.Linear(3, 2)
    fresh_model.load_state_dict(model.state_dict())
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=0.1, weight_decay=0.01)
    for net, opt in ((model, optimizer), (fresh_model, fresh)):  # the first update after the switch
        opt.zero_grad()
        net(torch.ones(1, 3)).sum().backward()
        opt.step()
    for after_reset, new in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(after_reset, new)  # = a new AdamW from the step-200 weights


def test_a_run_resumed_after_the_switch_gets_the_clip_again():
    trainer = SimpleNamespace(optimizer=None, epsilon_high=0.28)
    switch = ScaffoldSwitch(switch_step=2, epsilon=0.2)
    switch.trainer = trainer
    switch.on_step_begin(None, SimpleNamespace(global_step=1), None)
    assert trainer.epsilon_high == 0.28
    switch.on_step_begin(None, SimpleNamespace(global_step=5), None)
    assert trainer.epsilon_high == 0.2


def test_reset_optimizer_state_refuses_what_holds_no_torch_optimizer():
    with pytest.raises(TypeError, match="no torch optimizer inside SimpleNamespace"):
        reset_optimizer_state(SimpleNamespace())


# ---------------------------------------------------------------------------------- parallel checks


WELL_FORMED = "a<Parallel><Path>x</Path><Path>y</Path></Parallel><Summary>s</Summary> Final Answer: 1"


@pytest.mark.parametrize("text, authors, algorithm1", [
    (WELL_FORMED, True, True),
    ("no block. Final Answer: 1", False, False),
    (WELL_FORMED + " </Summary>", True, False),  # a stray </Summary>: the authors never check it
    ("<Parallel><Path>x</Path><Path>y</Path></Parallel><Summary>s", True, False),  # summary left open
    ("<Parallel>h<Path>x</Path><Path>y</Path></Parallel>t<Summary>s</Summary>", True, True),
    ("<Path>p</Path><Parallel><Path>x</Path><Path>y</Path></Parallel><Summary>s</Summary>", True, False),
    ("<Parallel><Path>x</Path></Parallel><Summary>s</Summary>", False, False),  # one path
    ("<Parallel><Path>x</Path><Path>y</Path></Parallel>", False, False),  # no summary
    ("<Parallel><Path>x</Path><Path>y</Path></Parallel><Summary>s</Summary></Path>", False, False),
    ("<Parallel><Path>x<Path>y</Path></Path></Parallel><Summary>s</Summary>", True, False),  # nested paths
])
def test_the_authors_check_is_looser_than_algorithm_1_where_their_code_is(text, authors, algorithm1):
    assert is_parallel(text, "authors") is authors
    assert is_parallel(text) is algorithm1 and check_format(text).ok is algorithm1


# ---------------------------------------------------------------------------------- broken-block metric


def test_broken_block_metric_is_zero_on_a_well_formed_unseen_sequence_under_the_real_template(tokenizer,
                                                                                              tags):
    prompt = tokenizer.encode(render_prompt(tokenizer, "What is 2 + 3?"), add_special_tokens=False)
    completion = tokenizer.encode(WELL_FORMED, add_special_tokens=False) + [tokenizer.eos_token_id]
    ids = torch.tensor([prompt + completion])
    mask = torch.ones_like(ids)
    # the template's own tag mentions ("Begin the block with <Parallel>", ...) break a block in the prompt
    assert build_structure(ids, mask, tags).broken_blocks >= 1
    assert completion_broken_blocks(ids, mask, len(completion), tags) == 0
    broken = tokenizer.encode("x</Path><Parallel><Path>a</Path><Path>b</Path></Parallel><Summary>s</Summary>",
                              add_special_tokens=False)
    ids = torch.tensor([prompt + broken])
    assert completion_broken_blocks(ids, torch.ones_like(ids), len(broken), tags) == 1
