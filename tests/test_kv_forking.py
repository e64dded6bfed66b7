"""KV forking and continuous scheduling (hf_forking.py) against re-prefill decoding, on the tiny models.

The reference is `kv_forking=False`: every segment re-encoded from scratch with the structure of
its whole token sequence, in rounds. Forked decoding must give the same tokens (greedy and
sampled with the same seeds) and the same log-probs, for Seen and Unseen, over several blocks,
2-4 paths, left-padded prompts of different lengths, EOS inside a path and paths cut by their
budget; and rows that join and retire mid-batch must not change any row's tokens.

The model runs in float64 here: forked and re-prefill decoding sum attention in different orders,
and with the random model's nearly flat distributions over 152k tokens a float32 difference of
1e-6 moves the sampler's inverse CDF across a token boundary every few hundred tokens (checked:
log-probs agreed to 2e-6 up to such a flip). In float64 the sampler sees identical float32 scores.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from parallel_r1.engine import RolloutConfig, transformers_engine
from parallel_r1.engine.base import KVSpan, SegmentRequest
from parallel_r1.engine.hf_forking import MIN_SHARED_PREFIX
from tests.test_engine import ScriptedBlocks
from tests.test_engine import tiny as tiny_float32  # noqa: F401  (the session fixture)


@pytest.fixture(scope="module")
def tiny(tiny_float32):  # noqa: F811
    """The engine tests' tiny Qwen3, in float64 (see the module docstring)."""
    import copy
    from types import SimpleNamespace

    return SimpleNamespace(**{**vars(tiny_float32), "model": copy.deepcopy(tiny_float32.model).double()})


class VariedBlocks(ScriptedBlocks):
    """Scripted blocks whose paths differ: a path closes after 2 + (its first token mod 5) tokens,
    and emits EOS instead when that first token is divisible by 4 (the engine closes it)."""

    def wanted(self, generated: list[int]) -> int | None:
        tags = self.tags
        marks = [i for i, t in enumerate(generated) if t in self.special]
        if marks and generated[marks[-1]] == tags.path_open:
            own = generated[marks[-1] + 1:]
            if own and len(own) == 2 + own[0] % 5:
                return self.eos if own[0] % 4 == 0 else tags.path_close
            return None
        return super().wanted(generated)


def rollouts(tiny, processor, kv_forking: bool, backend: dict | None = None, **settings):
    config: dict[str, Any] = dict(parallel=True, max_blocks=3, max_tokens=200, temperature=1.0, seed=5)
    config.update(settings)
    engine = transformers_engine(tiny.model, tiny.tokenizer, RolloutConfig(**config), kv_forking=kv_forking,
                                 logits_processor=processor, **(backend or {}))
    return engine, engine.generate(tiny.prompts, 2)


def assert_same_rollouts(forked, reference) -> None:
    for ours, theirs in zip(forked, reference, strict=True):
        assert ours.completion_ids == theirs.completion_ids
        assert ours.env_mask == theirs.env_mask and ours.num_blocks == theirs.num_blocks
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs),
                                   atol=1e-4, rtol=0)


def prompt_encoding(prompts, generations: int) -> int:
    """Prompt tokens the engine encodes for `generations` rollouts of each prompt: the prompts' common
    prefix once, each prompt's own rest once for its group, and each rollout its last token."""
    shared = 0
    while all(len(p) > shared + 1 and p[shared] == prompts[0][shared] for p in prompts):
        shared += 1
    assert shared >= MIN_SHARED_PREFIX  # the Parallel Thinking template
    return shared + sum(len(p) - 1 - shared for p in prompts) + len(prompts) * generations


def closed_by_engine(tiny, rollouts_) -> int:
    """Paths the engine had to close (EOS inside the path, or its budget)."""
    close = tiny.tags.path_close
    return sum(1 for r in rollouts_ for t, m in zip(r.completion_ids, r.env_mask, strict=False)
               if t == close and m == 0)


@pytest.mark.parametrize("structured", [False, True], ids=["seen", "unseen"])
@pytest.mark.parametrize("num_paths,temperature,max_tokens", [(2, 0.0, 200), (3, 1.0, 200), (4, 1.0, 48)],
                         ids=["2paths-greedy", "3paths-sampled", "4paths-sampled-cut"])
def test_forked_decoding_equals_reprefill(tiny, structured, num_paths, temperature, max_tokens):
    settings = dict(structured=structured, num_paths=num_paths, temperature=temperature,
                    max_tokens=max_tokens)
    _, forked = rollouts(tiny, VariedBlocks(tiny), True, **settings)
    _, reference = rollouts(tiny, VariedBlocks(tiny), False, **settings)
    assert_same_rollouts(forked, reference)
    assert sum(r.num_blocks for r in forked) >= 4  # several blocks per rollout were forked
    assert closed_by_engine(tiny, forked) > 0  # EOS inside a path, or (48 tokens) paths cut by their budget
    if max_tokens == 48:
        assert any(r.truncated for r in forked)


def test_unseen_forking_encodes_only_prompts_and_tags(tiny):
    """No re-prefill: besides the prompts, each block encodes `<Parallel>` once, each path its
    `<Path>` and its `</Path>`, the summary's `</Parallel>` `\\n` `<Summary>`, then `</Summary>`."""
    engine, forked = rollouts(tiny, ScriptedBlocks(tiny), True, structured=True, max_blocks=2)
    blocks = sum(r.num_blocks for r in forked)
    assert blocks == 8
    per_block = 1 + 2 * 2 + 3 + 1
    assert engine.backend.stats.encoded == prompt_encoding(tiny.prompts, 2) + blocks * per_block
    assert not engine.backend._kept  # the engine released every kept cache
    assert engine.backend._prefix is None  # and the call's shared prompt prefix


def test_seen_summary_reencodes_later_paths_only(tiny):
    """Causally a later path sees the paths before it, so its forked KV (which did not) is re-encoded."""
    engine, forked = rollouts(tiny, ScriptedBlocks(tiny), True, structured=False, max_blocks=2)
    prompt_tokens = prompt_encoding(tiny.prompts, 2)
    later_path = 1 + 3 + 1  # <Path>, 3 tokens, </Path>: the second path of every block
    per_block = 1 + 2 + 1 + later_path + 3 + 1  # as Unseen, but the second path's </Path> comes with it
    assert engine.backend.stats.encoded == prompt_tokens + sum(r.num_blocks for r in forked) * per_block


@pytest.mark.parametrize("structured", [False, True], ids=["seen", "unseen"])
def test_rows_joining_and_retiring_mid_batch_keep_their_tokens(tiny, structured):
    """Continuous batching (rows admitted every step, a 3-row pool so segments queue) gives the
    tokens of round-barrier batching and of re-prefill."""
    settings = dict(structured=structured, num_paths=3)
    _, continuous = rollouts(tiny, VariedBlocks(tiny), True, dict(max_batch_size=3), **settings)
    _, rounds = rollouts(tiny, VariedBlocks(tiny), True, dict(scheduling="rounds"), **settings)
    _, reference = rollouts(tiny, VariedBlocks(tiny), False, **settings)
    assert len({len(r.completion_ids) for r in continuous}) > 1  # rows retire at different steps
    assert_same_rollouts(continuous, reference)
    assert_same_rollouts(rounds, reference)


def test_streamed_request_tokens_do_not_depend_on_batch_neighbours(tiny):
    engine = transformers_engine(tiny.model, tiny.tokenizer, RolloutConfig())
    backend = engine.backend
    eos = frozenset({tiny.eos})
    requests = [SegmentRequest(tuple(p), 6, eos, seed=seed)
                for p, seed in zip(tiny.prompts, (5, 9), strict=False)]

    def run(batch):
        tickets = [backend.submit(r) for r in batch]
        done = {}
        while len(done) < len(tickets):
            done.update(backend.step())
        return [done[t] for t in tickets]

    together, alone = run(requests), run(requests[1:])
    assert together[1].token_ids == alone[0].token_ids == backend.continue_batch(requests[1:])[0].token_ids
    assert together[1].logprobs == pytest.approx(alone[0].logprobs, abs=1e-4)


def test_a_shared_prompt_prefix_never_outlives_its_call(tiny):
    """A live policy changes in place between GRPO steps: the next call must not reuse the prompt
    columns the old weights computed."""
    import copy

    model = copy.deepcopy(tiny.model)
    config = RolloutConfig(parallel=True, max_tokens=24, temperature=1.0, seed=3)
    engine = transformers_engine(model, tiny.tokenizer, config)
    engine.generate(tiny.prompts, 2, call=0)
    with torch.no_grad():
        for weight in model.parameters():
            weight.mul_(1.5)
    fresh = transformers_engine(model, tiny.tokenizer, config, kv_forking=False)
    assert_same_rollouts(engine.generate(tiny.prompts, 2, call=1), fresh.generate(tiny.prompts, 2, call=1))


def test_wrong_kv_hint_costs_speed_not_exactness(tiny):
    """A span naming a cache that does not hold those tokens is ignored column by column."""
    engine = transformers_engine(tiny.model, tiny.tokenizer, RolloutConfig(temperature=0.0))
    backend = engine.backend
    eos = frozenset({tiny.eos})
    first = SegmentRequest(tuple(tiny.prompts[0]), 3, eos, temperature=0.0, kv_key="a")
    backend.submit(first)
    while not backend.step():
        pass
    other = tuple(tiny.prompts[1])
    misled = SegmentRequest(other, 4, eos, temperature=0.0, kv_spans=(KVSpan("a", 0, len(other)),))
    ticket = backend.submit(misled)
    result = {}
    while ticket not in result:
        result.update(backend.step())
    assert result[ticket].token_ids == backend.continue_batch([misled])[0].token_ids


def test_llama_model_forks_exactly(tiny):
    """Not Qwen3-specific: a tiny Llama (tied embeddings, as SmolLM2) decodes Unseen exactly too."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tiny.tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         tie_word_embeddings=True,
                         pad_token_id=tiny.tokenizer.pad_token_id, eos_token_id=tiny.eos)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        for weight in model.model.layers.parameters():
            if weight.ndim == 2:
                weight.normal_(0, 0.3)
    llama = SimpleNamespace(**{**vars(tiny), "model": model})
    for structured in (False, True):
        _, forked = rollouts(llama, VariedBlocks(llama), True, structured=structured, num_paths=3)
        _, reference = rollouts(llama, VariedBlocks(llama), False, structured=structured, num_paths=3)
        assert_same_rollouts(forked, reference)
        assert sum(r.num_blocks for r in forked) >= 4
