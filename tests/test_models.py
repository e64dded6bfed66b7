"""Model preparation: the tiny random-init Qwen3, the tags as special tokens, bad checkpoints."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from parallel_r1.errors import PipelineError
from parallel_r1.format import TAGS
from parallel_r1.models import (
    TinyModelConfig,
    build_tiny_model,
    check_model_dir,
    load_model,
    prepare_base_model,
    qwen3_tokenizer_dir,
)

SMALL = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16)


def test_tags_are_single_special_tokens(tokenizer):
    ids = tokenizer.convert_tokens_to_ids(list(TAGS))
    assert len(set(ids)) == 6 and min(ids) >= 151669
    encoded = tokenizer("a<Parallel><Path>b</Path></Parallel>", add_special_tokens=False)["input_ids"]
    assert ids[0] in encoded and ids[2] in encoded and ids[3] in encoded
    assert tokenizer.decode(encoded, skip_special_tokens=False).count("<Path>") == 1


def test_tiny_model_is_seeded_and_deterministic(tokenizer):
    first, second = build_tiny_model(tokenizer, SMALL), build_tiny_model(tokenizer, SMALL)
    other = build_tiny_model(tokenizer, TinyModelConfig(**{**SMALL.__dict__, "seed": 1}))
    for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=False):
        assert torch.equal(a, b)
    assert not torch.equal(first.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert first.config.vocab_size == len(tokenizer)


def test_prepared_tiny_model_round_trips(tmp_path):
    path = prepare_base_model("tiny", tmp_path / "base", tiny=SMALL)
    model, tokenizer = load_model(path)
    assert model.config.hidden_size == 32
    assert tokenizer.convert_tokens_to_ids("<Summary>") < model.config.vocab_size
    assert not list(tmp_path.glob(".base.*")), "no temporary folder left behind"


def test_pretrained_folder_gets_tags_at_their_spelling_mean(tmp_path):
    plain = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))
    model = build_tiny_model(plain, SMALL)
    model.save_pretrained(tmp_path / "pretrained")
    plain.save_pretrained(tmp_path / "pretrained")
    prepared, tokenizer = load_model(prepare_base_model(str(tmp_path / "pretrained"), tmp_path / "base",
                                                        "float32"))
    tag_ids = tokenizer.convert_tokens_to_ids(list(TAGS))
    weight = prepared.get_input_embeddings().weight
    assert weight.shape[0] == len(tokenizer) == len(plain) + 6
    original = model.get_input_embeddings().weight
    for tag, tag_id in zip(TAGS, tag_ids, strict=False):
        # "<", "Parallel", ">" before the tags exist
        pieces = plain(tag, add_special_tokens=False)["input_ids"]
        assert len(pieces) > 1
        torch.testing.assert_close(weight[tag_id], original[pieces].mean(dim=0))
    assert not torch.allclose(weight[tag_ids[0]], weight[tag_ids[2]])  # each tag its own start, not one mean


def test_bad_checkpoints_fail_in_one_line(tmp_path):
    with pytest.raises(PipelineError, match="model folder not found"):
        check_model_dir(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PipelineError, match="no config.json"):
        check_model_dir(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(PipelineError, match="no weights"):
        check_model_dir(tmp_path / "empty")


def test_unreachable_base_model_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PipelineError, match="neither a local model folder nor a reachable Hub id"):
        prepare_base_model("Qwen/Qwen3-4B-Base", tmp_path / "base")
