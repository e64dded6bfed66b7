"""The decode-speed pieces of the transformers engine compute exactly what they replace.

- `sdpa_gqa` (engine/attention.py): SDPA with grouped KV heads passed as they are must give the
  logits of transformers' "sdpa" (which copies each KV head per query group) under a padding
  mask, a structured path-window mask, and with a KV cache.
- its bf16/fp16 decode step (`grouped_decode_attention`, one query token: the CPU SDPA kernel
  is slow there) must compute attention under bool, additive and no masks.
- `GrowingLayer` (engine/kv_pool.py): appending into spare columns must hold what
  concatenation holds, without reallocating while there is room, and must take tensors the pool
  put in place (rows joined or left) as the new contents.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from parallel_r1.engine.attention import GQA_SDPA, gqa_sdpa_forward, grouped_decode_attention, use_gqa_sdpa
from parallel_r1.engine.kv_pool import GrowingLayer
from parallel_r1.models import TinyModelConfig, build_tiny_model, load_tokenizer, qwen3_tokenizer_dir
from parallel_r1.prompts import render_prompt
from parallel_r1.structure import TagIds, attention_inputs, build_structure
from tests.conftest import redraw_layer_weights

BLOCK = ("Step one. <Parallel><Path>2 + 2 = 4</Path><Path>two twos make 4</Path></Parallel>\n"
         "<Summary>4</Summary> So 4.")


def grouped_models():
    """A float64 tiny model with 4 query heads per KV head, as "sdpa" and as "sdpa_gqa"."""
    tokenizer = load_tokenizer(qwen3_tokenizer_dir())
    model = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=64, intermediate_size=128,
                                                        num_hidden_layers=2, num_attention_heads=4,
                                                        num_key_value_heads=1, head_dim=16))
    model = redraw_layer_weights(model).double().eval()
    grouped = copy.deepcopy(model)
    use_gqa_sdpa(grouped)
    return tokenizer, model, grouped


def test_gqa_sdpa_gives_sdpa_logits_under_padding_structure_and_cache():
    tokenizer, model, grouped = grouped_models()
    assert model.config._attn_implementation == "sdpa" and grouped.config._attn_implementation == GQA_SDPA
    tokenizer.padding_side = "left"
    texts = [render_prompt(tokenizer, "What is 2 + 2?") + BLOCK, render_prompt(tokenizer, "Add 1 and 3.")]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    structure = build_structure(batch["input_ids"], batch["attention_mask"], TagIds.from_tokenizer(tokenizer))
    with torch.no_grad():
        for forward in (dict(attention_mask=batch["attention_mask"]),
                        attention_inputs(structure, "sdpa", torch.float64)):
            ours = grouped(input_ids=batch["input_ids"], **forward).logits
            theirs = model(input_ids=batch["input_ids"], **forward).logits
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)
        # one cached decode step over the padded batch
        steps = []
        for net in (model, grouped):
            out = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=True)
            mask = torch.cat([batch["attention_mask"], torch.ones_like(batch["attention_mask"][:, :1])],
                             dim=1)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            steps.append(net(input_ids=nxt, attention_mask=mask, past_key_values=out.past_key_values,
                             use_cache=True).logits)
        torch.testing.assert_close(steps[1], steps[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
def test_grouped_decode_attention_is_attention_under_every_mask_kind(mask_kind):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(5, 9, 1, 64, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(5, 3, 40, 64, generator=generator, dtype=torch.float64) for _ in range(2))
    allowed = torch.rand(5, 1, 1, 40, generator=generator) > 0.3
    allowed[..., -1] = True  # a decoding row always sees its own column
    mask = {"bool": allowed, "none": None,
            "additive": torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, -1e30),
            }[mask_kind]
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    expected = sdpa_attention_forward(module, query, key, value, mask)[0]
    torch.testing.assert_close(grouped_decode_attention(query, key, value, mask, None), expected,
                               rtol=0, atol=1e-6)  # its softmax runs in float32
    # a bf16 decode step takes this path, within bf16 rounding of the float64 attention
    low = [t.bfloat16() for t in (query, key, value)]
    got = gqa_sdpa_forward(module, *low, mask if mask_kind != "additive" else mask.bfloat16())[0]
    assert torch.equal(got, grouped_decode_attention(*low,
                                                     mask if mask_kind != "additive" else mask.bfloat16(),
                                                     None))
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=0.03)


def test_gqa_sdpa_leaves_other_implementations_alone():
    tokenizer = load_tokenizer(qwen3_tokenizer_dir())
    model = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=32, intermediate_size=64,
                                                        num_hidden_layers=1, num_attention_heads=2,
                                                        num_key_value_heads=1, head_dim=16))
    model.set_attn_implementation("eager")
    use_gqa_sdpa(model)
    assert model.config._attn_implementation == "eager"


def test_growing_layer_appends_in_place_and_matches_concatenation():
    generator = torch.Generator().manual_seed(1)

    def chunk(columns: int) -> torch.Tensor:
        return torch.randn(2, 3, columns, 4, generator=generator)

    layer = GrowingLayer()
    keys, values = chunk(5), chunk(5)
    layer.update(keys, values)
    storage = layer.keys.untyped_storage().data_ptr()
    for _ in range(GrowingLayer.SPARE):  # fills the spare columns: no reallocation
        new_keys, new_values = chunk(1), chunk(1)
        keys, values = torch.cat([keys, new_keys], dim=2), torch.cat([values, new_values], dim=2)
        got_keys, got_values = layer.update(new_keys, new_values)
        assert got_keys.untyped_storage().data_ptr() == storage
        assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
    new_keys, new_values = chunk(1), chunk(1)  # full: one reallocation, contents kept
    layer.update(new_keys, new_values)
    assert layer.keys.untyped_storage().data_ptr() != storage
    assert torch.equal(layer.keys, torch.cat([keys, new_keys], dim=2))

    # the pool replaces the tensors (a row left): the next update starts from them
    kept_keys, kept_values = layer.keys[:1].clone(), layer.values[:1].clone()
    layer.keys, layer.values = kept_keys, kept_values
    new_keys, new_values = chunk(1)[:1], chunk(1)[:1]
    got_keys, got_values = layer.update(new_keys, new_values)
    assert torch.equal(got_keys, torch.cat([kept_keys, new_keys], dim=2))
    assert torch.equal(got_values, torch.cat([kept_values, new_values], dim=2))
