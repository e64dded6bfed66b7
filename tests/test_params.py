"""params.yaml and conf/: profiles compose, the paper profile matches the paper, bad params fail clearly."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
import yaml

from parallel_r1.config import from_mapping
from parallel_r1.errors import PipelineError
from parallel_r1.models import TinyModelConfig
from stages.common import load_params
from stages.profiles import compose, differences, edits, profile_names, switch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def paper():
    return compose(REPO, "paper")


@pytest.fixture(scope="module")
def reference():
    return yaml.safe_load(resources.files("parallel_r1").joinpath("paper_results.yaml").read_text())


def test_packaged_paper_results_match_the_shared_copy(reference):
    shared = REPO.parent / "shared" / "paper" / "paper_results.yaml"
    if not shared.is_file():
        pytest.skip("no shared paper_results.yaml beside the checkout")
    assert yaml.safe_load(shared.read_text()) == reference


def test_paper_profile_sft_matches_the_paper(paper, reference):
    expected = reference["hyperparameters"]["sft"]
    sft = paper["sft"]
    assert sft["batch_size"] == expected["batch_size"]
    assert sft["lr"] == expected["lr"]
    assert sft["weight_decay"] == expected["weight_decay"]
    assert sft["warmup_ratio"] == expected["warmup_ratio"]
    assert sft["lr_scheduler"] == expected["schedule"]
    variants = paper["sft_variants"]
    assert (variants["seen"]["max_steps"], variants["unseen"]["max_steps"]) == (expected["grad_updates_seen"],
                                                                               expected["grad_updates_unseen"])
    assert sft["max_length"] == 4096


def test_paper_profile_rl_matches_the_paper(paper, reference):
    hyper = reference["hyperparameters"]
    gsm8k, dapo = paper["rl_datasets"]["gsm8k"], paper["rl_datasets"]["dapo"]
    assert (gsm8k["batch_size"], gsm8k["num_generations"], gsm8k["max_steps"]) == (
        hyper["rl_gsm8k"]["batch_size"], hyper["rl_gsm8k"]["rollouts"], hyper["rl_gsm8k"]["grad_updates"])
    assert (dapo["batch_size"], dapo["num_generations"], dapo["max_steps"]) == (
        hyper["rl_dapo"]["batch_size"], hyper["rl_dapo"]["rollouts"], hyper["rl_dapo"]["grad_updates"])
    assert paper["rl"]["lr"] == hyper["rl_gsm8k"]["lr"] == hyper["rl_dapo"]["lr"]
    assert paper["rl"]["warmup_ratio"] == 0.0 and paper["rl"]["lr_scheduler"] == "constant"
    assert paper["rl"]["beta"] == 0.0 and paper["rl"]["epsilon"] == 0.2
    assert paper["rl_runs"]["parallel_r1_unseen_s2"]["epsilon_high"] == 0.28
    assert (paper["rl"]["max_completion_tokens"], paper["rl"]["num_paths"],
            paper["rl"]["max_blocks"]) == (3000, 2, 4)


def test_paper_profile_rewards_and_eval_match_the_paper(paper, reference):
    hyper = reference["hyperparameters"]
    tiered = hyper["s2_alternating"]["tiered_reward"]
    rewards = {**paper["rewards"], **paper["reward_schedules"]["alternating"]}
    assert paper["reward_schedules"]["scaffold"] == {**paper["reward_schedules"]["alternating"],
                                                     "switch_step": reference["scaffold"]["switch_step"]}
    assert rewards["window"] == hyper["s2_alternating"]["window_steps"]
    assert (1 - rewards["tiered_steps"] / rewards["window"]
            == pytest.approx(hyper["s2_alternating"]["accuracy_share"]))
    assert (rewards["tiered_parallel_reward"], rewards["tiered_correct_reward"],
            rewards["incorrect_reward"]) == (tiered["correct_with_parallel"],
                                             tiered["correct_without_parallel"], tiered["otherwise"])
    evaluate = paper["evaluate"]
    assert evaluate["temperature"] == hyper["eval"]["temperature"]
    assert evaluate["benchmarks"]["math"]["k"] == hyper["eval"]["math_samples"]
    assert ({evaluate["benchmarks"][b]["k"] for b in ("aime24", "aime25", "amc23")}
            == {hyper["eval"]["other_samples"]})
    assert paper["model"]["base"] == reference["base_model"]
    assert paper["generate"]["teacher"] == reference["teacher_model"]


def keys(tree: dict, where: str = "") -> set[str]:
    return {path for key, value in tree.items()
            for path in (keys(value, f"{where}{key}.") if isinstance(value, dict) and value
                         else {f"{where}{key}"})}


def without_run_overrides(found: set[str]) -> set[str]:
    """Keys less a run entry's optional overrides of its dataset's and rl's values (stages.rl RUN_OVERRIDES):
    a profile sets them only for the runs it trains differently (the small profile's runs that can move);
    the entries of evaluate.inits count as the one key."""
    from stages.rl import RUN_OVERRIDES

    # evaluate.inits maps run names to inits, as rl_runs does: its entries are a profile's own (empty: a leaf)
    return {"evaluate.inits" if key.startswith("evaluate.inits.") else key for key in found
            if not (key.startswith("rl_runs.") and key.rsplit(".", 1)[1] in RUN_OVERRIDES)}


@pytest.mark.parametrize(("profile", "base"), [("tiny", "tiny"), ("small", "smollm2-135m-instruct")])
def test_every_profile_sets_the_keys_the_paper_profile_sets(profile, base):
    # a complete file per profile: a knob missing from one would silently fall back to nothing
    composed = compose(REPO, profile)
    found = without_run_overrides(keys(composed))
    paper = without_run_overrides(keys(compose(REPO, "paper")))
    assert paper - found == set()
    # beyond the paper's: the tiny model's sizes, the small profile's generated problems (data.arithmetic, the
    # entries that read them, their evaluation) and report keys whose defaults a profile overrides
    extra = {key for key in found - paper
             if not key.startswith(("model.tiny.", "data.arithmetic.", "data.eval.arithmetic.",
                                    "evaluate.benchmarks.arithmetic.", "reports."))
             and not (key.startswith("data.") and key.endswith((".level", ".split")))}
    assert extra == set()
    assert composed["model"]["base"] == base and composed["profile"] == profile


def test_profile_files_are_the_profiles_and_each_names_itself():
    assert profile_names(REPO) == ["paper", "small", "tiny"]
    for name in profile_names(REPO):
        assert compose(REPO, name)["profile"] == name


def test_committed_params_yaml_is_the_default_profiles_composition():
    # params.yaml is generated from conf/ (stages/profiles.py); DVC and the stages read it, so it must not
    # drift
    assert load_params(REPO / "params.yaml")["profile"] == "small"
    assert edits(REPO) == []


def test_switching_profile_refuses_to_drop_a_hand_edit(tmp_path):
    import shutil

    shutil.copytree(REPO / "conf", tmp_path / "conf")
    switch(tmp_path, "tiny")
    text = (tmp_path / "params.yaml").read_text()
    (tmp_path / "params.yaml").write_text(text.replace("max_completion_tokens: 48",
                                                       "max_completion_tokens: 40"))
    with pytest.raises(PipelineError, match=r"^params.yaml: 1 value\(s\) differ from its profile's "
                                            r"composition "
                                            r"\(first: rl.max_completion_tokens\)"):
        switch(tmp_path, "paper")
    assert "max_completion_tokens: 40" in (tmp_path / "params.yaml").read_text()   # nothing lost
    switch(tmp_path, "paper", force=True)
    assert load_params(tmp_path / "params.yaml")["profile"] == "paper"


def test_differences_name_changed_added_and_missing_keys():
    assert differences({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3, "d": 4}}) == ["a.c", "a.d"]
    assert differences({"a": 1}, {}) == ["a"]


def test_unknown_profile_is_one_line():
    with pytest.raises(PipelineError,
                       match=r"^conf/profile/huge.yaml: no such profile \(choose from paper, small, tiny\)"):
        compose(REPO, "huge")


def test_params_without_a_profile_name_is_one_line(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("seed: 1\n")
    with pytest.raises(PipelineError, match=r"params.yaml: no `profile` name"):
        load_params(path)


def test_typed_options_reject_bad_values():
    with pytest.raises(PipelineError, match=r"model.tiny.hidden_size: must be >= 8, got -4"):
        from_mapping(TinyModelConfig, {"hidden_size": -4}, "params.yaml model.tiny")
    with pytest.raises(PipelineError, match=r"unknown key 'hiden_size'"):
        from_mapping(TinyModelConfig, {"hiden_size": 4}, "params.yaml model.tiny")
    with pytest.raises(PipelineError, match=r"num_hidden_layers: expected int, got 'two'"):
        from_mapping(TinyModelConfig, {"num_hidden_layers": "two"}, "params.yaml model.tiny")


def test_relative_mirror_is_anchored_at_the_dvc_root(tmp_path, monkeypatch):
    path = tmp_path / "params.yaml"
    path.write_text("profile: tiny\ndata: {mirror_dir: ../shared/data}\n")
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "project"))
    assert load_params(path)["data"]["mirror_dir"] == str(tmp_path / "shared" / "data")
    path.write_text("profile: tiny\ndata: {mirror_dir: /abs/mirror}\n")
    assert load_params(path)["data"]["mirror_dir"] == "/abs/mirror"
