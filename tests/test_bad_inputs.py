"""Every bad input is one line naming the file (and line) or the param path, and the problem."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import one_line_error, teacher_row, write_teacher
from parallel_r1.errors import PipelineError
from parallel_r1.io import read_json, read_jsonl
from parallel_r1.models import check_model_dir, load_tokenizer, qwen3_tokenizer_dir


def fake_model_dir(folder: Path) -> Path:
    """A model folder as check_model_dir sees it: real tokenizer files, a config, tiny real weights."""
    import torch
    from safetensors.torch import save_file

    shutil.copytree(qwen3_tokenizer_dir(), folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    save_file({"w": torch.zeros(64)}, str(folder / "model.safetensors"))
    return folder


# ---------------------------------------------------------------- case 3: decode and load errors


def test_invalid_utf8_in_a_jsonl_line_is_one_line_with_file_and_line(workdir, capsys):
    from stages.filter import main

    good = json.dumps(teacher_row()).encode()
    write_teacher(workdir, "gsm8k", good + b"\n" + good.replace(b'"q"', b'"\xff\xfeq"') + b"\n")
    line = one_line_error(main, capsys)
    assert line == "error: data/teacher/gsm8k.jsonl:2: not valid UTF-8 (byte 28 of the line)"


def test_invalid_utf8_in_a_json_file_names_file_and_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b'{\n  "a": "\xc3"\n}\n')
    with pytest.raises(PipelineError, match=r"config.json:2: not valid UTF-8"):
        read_json(path)
    path.write_bytes(b'{\n  "a": 1,\n}\n')
    with pytest.raises(PipelineError, match=r"config.json:3: not valid JSON \(Expecting property name"):
        read_json(path)


def test_a_model_json_file_corrupted_after_a_check_fails_the_next_check(tmp_path):
    """check_json_files skips contents it has parsed before (by digest), never a file that changed."""
    from parallel_r1.models import check_json_files

    (tmp_path / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    check_json_files(tmp_path)
    check_json_files(tmp_path)  # the same contents: recognised, still fine
    (tmp_path / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}')
    with pytest.raises(PipelineError, match=r"tokenizer.json:1: not valid JSON"):
        check_json_files(tmp_path)


@pytest.mark.parametrize("damage", [lambda data: data[: len(data) // 2], lambda data: b"\0" * len(data)],
                         ids=["truncated", "garbled"])
def test_corrupt_safetensors_stops_the_stage_in_one_line(workdir, capsys, damage):
    from stages.rl import main

    weights = fake_model_dir(workdir / "models" / "base") / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    line = one_line_error(main, capsys, ["grpo_gsm8k"])
    assert line.startswith("error: models/base/model.safetensors: corrupt or truncated safetensors file (")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "config.json"])
def test_corrupt_model_json_names_the_file_and_line(tmp_path, name):
    folder = fake_model_dir(tmp_path / "model")
    (folder / name).write_text('{\n  "version": \n')
    with pytest.raises(PipelineError, match=rf"^{folder / name}:3: not valid JSON \(Expecting value"):
        check_model_dir(folder)
    with pytest.raises(PipelineError, match=rf"^{folder / name}:3: not valid JSON"):
        load_tokenizer(folder)


def test_yaml_syntax_error_in_params_names_file_line_and_column(workdir, capsys):
    from stages.prepare_data import main

    text = (workdir / "params.yaml").read_text()
    (workdir / "params.yaml").write_text(text.replace("seed: 42", "seed: [42", 1))
    line = one_line_error(main, capsys)
    match = re.fullmatch(r"error: params.yaml:(\d+):\d+: YAML syntax error \(.+\)", line)
    seed_line = text.splitlines().index("seed: 42") + 1
    assert match and seed_line <= int(match.group(1)) <= seed_line + 2, line   # YAML notices at the next key


def test_jsonl_lines_are_counted_from_one_even_after_blank_lines(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2\n')
    with pytest.raises(PipelineError, match=r"rows.jsonl:3: not valid JSON"):
        read_jsonl(path)


# ---------------------------------------------------------------- case 6: tags inside a question


@pytest.mark.parametrize("style", ["parallel", "baseline"])
def test_tags_in_a_question_never_become_tag_tokens(tokenizer, style):
    from parallel_r1.format import TAGS
    from parallel_r1.prompts import render_prompt

    tag_ids = set(tokenizer.convert_tokens_to_ids(list(TAGS)))

    def tag_tokens(question: str) -> list[int]:
        ids = tokenizer(render_prompt(tokenizer, question, style), add_special_tokens=False)["input_ids"]
        return [i for i in ids if i in tag_ids]

    tagged = "Is <Parallel><Path>2+2</Path><Path>4</Path></Parallel><Summary>4</Summary> right?"
    # Only the template's own instructions (the Parallel Thinking prompt names the tags) hold tag ids.
    assert tag_tokens(tagged) == tag_tokens("Is 2+2 4 right?")
    assert style == "parallel" or tag_tokens(tagged) == []
    assert "<\u200bPath>2+2<\u200b/Path>" in render_prompt(tokenizer, tagged, style)


# ---------------------------------------------------------------- case 7: smaller message fixes


def test_row_with_a_missing_field_is_named_by_its_line_counted_from_one(tmp_path):
    from parallel_r1.data import load_problems

    (tmp_path / "eval").mkdir()
    lines = [json.dumps({"id": "a", "problem": "q", "ground_truth": "1"}), "",
             json.dumps({"id": "b", "problem": "q"})]
    (tmp_path / "eval" / "aime24.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(PipelineError) as error:
        load_problems("aime24", tmp_path)
    expected = f"{tmp_path}/eval/aime24.jsonl:3: dataset aime24, id b: missing field ground_truth"
    assert str(error.value) == expected


def test_missing_completion_is_reported_as_missing_not_as_a_wrong_type(workdir, capsys):
    from stages.filter import main

    row = teacher_row()
    del row["completion"]
    write_teacher(workdir, "gsm8k", (json.dumps(row) + "\n").encode())
    assert one_line_error(main, capsys) == "error: data/teacher/gsm8k.jsonl:1: missing field completion"


@pytest.mark.parametrize("key, value, message", [
    ("window", 0, "params.yaml rewards.window: must be >= 1, got 0"),
    ("tiered_steps", 5, "params.yaml rewards.tiered_steps: must be in [0, window=2], got 5"),
    ("checker", "exact", "params.yaml rewards.checker: 'exact' is unknown"),
])
def test_reward_param_errors_name_the_param_path(key, value, message):
    from parallel_r1.config import from_mapping
    from parallel_r1.rewards import RewardConfig

    with pytest.raises(PipelineError) as error:
        from_mapping(RewardConfig, {"window": 2, "tiered_steps": 1, key: value}, "params.yaml rewards")
    assert str(error.value).startswith(message)


def test_unknown_reward_schedule_names_the_run_param(workdir, capsys):
    from conftest import set_param
    from stages.rl import main

    set_param(workdir / "params.yaml", "rl_runs.grpo_gsm8k.reward", "kindness")
    line = one_line_error(main, capsys, ["grpo_gsm8k"])
    assert line.startswith("error: params.yaml rl_runs.grpo_gsm8k.reward: unknown schedule 'kindness' "
                           "(known: ")


# ---------------------------------------------------------------- a config that does not match the weights

@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from parallel_r1.models import prepare_base_model

    return prepare_base_model("tiny", tmp_path_factory.mktemp("tiny") / "base")


def edited_copy(source: Path, folder: Path, **config_changes) -> Path:
    """`source` with its config.json edited (the other files linked, not copied)."""
    folder.mkdir()
    for item in source.iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **{key: change(config[key]) for key, change
                                                                  in config_changes.items()}}))
    return folder


MISMATCH = "config.json does not match the weights: tensor "
ONE_MORE, ONE_LESS = (
    {"num_hidden_layers": lambda n: n + 1, "layer_types": lambda types: types + types[-1:]},
    {"num_hidden_layers": lambda n: n - 1, "layer_types": lambda types: types[:-1]})


@pytest.mark.parametrize("change, message", [
    (ONE_MORE, MISMATCH + "model.layers.2.input_layernorm.weight and 10 more missing "
                          "in the safetensors files"),
    (ONE_LESS, MISMATCH + "model.layers.1.input_layernorm.weight and 10 more unexpected "
                          "in the safetensors files"),
    ({"intermediate_size": lambda n: n * 2},
     MISMATCH + "model.layers.0.mlp.down_proj.weight and 5 more with a different shape "
                "in the safetensors files"),
    ({"num_hidden_layers": lambda n: n + 1},   # the config contradicts itself
     "cannot load model (`num_hidden_layers` (3) must be equal to the number of `layer_types` (2))"),
])
def test_tiny_model_whose_config_does_not_match_its_weights_is_refused(tiny_model_dir, tmp_path, change,
                                                                       message):
    """Used to load with the missing layer at random (transformers' "newly initialized" table only)."""
    from parallel_r1.models import load_model

    folder = edited_copy(tiny_model_dir, tmp_path / "sft_seen", **change)
    with pytest.raises(PipelineError) as error:
        load_model(folder)
    assert str(error.value) == f"{folder}: {message}"
    load_model(tiny_model_dir)   # the unedited folder loads


@pytest.mark.parametrize("change, message", [
    (ONE_MORE, MISMATCH + "model.layers.2.input_layernorm.weight and 10 more missing "
                          "in the safetensors files"),
    (ONE_LESS, MISMATCH + "model.layers.1.input_layernorm.weight and 10 more unexpected "
                          "in the safetensors files"),
    ({"intermediate_size": lambda n: n * 2},
     MISMATCH + "model.layers.0.mlp.down_proj.weight and 5 more with a different shape "
                "in the safetensors files"),
])
def test_mismatch_is_found_without_loading_for_the_vllm_engine(tiny_model_dir, tmp_path, change, message):
    from parallel_r1.models import check_weights_match_config

    folder = edited_copy(tiny_model_dir, tmp_path / "sft_seen", **change)
    with pytest.raises(PipelineError) as error:
        check_weights_match_config(folder)
    assert str(error.value) == f"{folder}: {message}"
    check_weights_match_config(tiny_model_dir)


def test_unknown_rl_init_is_named_by_its_param_path(workdir, capsys):
    """Used to say `models/nope_model: model folder not found`."""
    from conftest import set_param
    from stages.rl import main

    set_param(workdir / "params.yaml", "rl_runs.grpo_gsm8k.init", "nope_model")
    line = one_line_error(main, capsys, ["grpo_gsm8k"])
    assert line.startswith("error: params.yaml rl_runs.grpo_gsm8k.init: 'nope_model' names no model: "
                           "models/nope_model not found (known: base, sft_seen, sft_unseen, ")
    set_param(workdir / "params.yaml", "rl_runs.grpo_gsm8k.init", "sft_seen")
    line = one_line_error(main, capsys, ["grpo_gsm8k"])
    assert line.startswith("error: params.yaml rl_runs.grpo_gsm8k.init: 'sft_seen' is not written yet "
                           "(run its stage first): models/sft_seen not found (known: ")
