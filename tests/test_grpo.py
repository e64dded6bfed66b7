"""GRPO with parallel rollouts: options -> GRPOConfig, structured log-probs, end-to-end runs, resume, stage.

The tiny policy (hidden 32, 1 layer, the real Qwen3 tokenizer) almost never writes a tag, so the
end-to-end runs place them with `ForkSomeRollouts`, a logits processor handed to the rollout
backend: rollouts whose first sampled token id is a multiple of 3 open `<Parallel>` (the engine then forks
the paths and inserts its tags), the others answer plainly. Everything else -- forking, rewards,
advantages, structured log-probs, the update, checkpoints -- is the real code path.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import astuple
from pathlib import Path

import pytest
import torch
import yaml
from transformers import TrainerCallback
from trl import GRPOTrainer

from conftest import write_profile_params
from parallel_r1.engine import vllm_available
from parallel_r1.errors import PipelineError
from parallel_r1.io import read_json, write_jsonl
from parallel_r1.models import TinyModelConfig, build_tiny_model, load_model
from parallel_r1.rewards import RewardConfig, build_reward
from parallel_r1.structure import TagIds, attention_inputs, build_structure
from parallel_r1.training.grpo import RLOptions, batch_layout, grpo_config, rl_dataset, train_rl
from parallel_r1.training.grpo_trainer import (
    STEP_KEYS,
    EpochSeededRepeatSampler,
    ParallelGRPOTrainer,
    step_records,
)

REPO = Path(__file__).resolve().parents[1]
TINY = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16)
PROBLEMS = [
    {"id": "p1", "question": "What is 2 + 3?", "ground_truth": "5", "answer_kind": "gsm8k", "dataset": "t"},
    {"id": "p2", "question": "A farmer has 12 cows and buys 7 more. How many cows?", "ground_truth": "19",
     "answer_kind": "gsm8k", "dataset": "t"},
]
RL = {"lr": 1.0e-3, "beta": 0.0, "epsilon": 0.2, "temperature": 1.0, "top_p": 1.0, "max_prompt_tokens": 2000,
      "max_completion_tokens": 24, "num_paths": 2, "max_blocks": 4, "engine": "transformers",
      "per_device_batch_size": 4, "save_steps": 1, "gradient_checkpointing": False,
      "datasets": {"gsm8k": {"batch_size": 1, "num_generations": 4, "max_steps": 1}}}
RUN = {"init": "base", "dataset": "gsm8k", "reward": "parallel_only", "variant": "seen", "prompt": "parallel",
       "parallel": True}


def options(rl=None, snapshot_every=None, **run) -> RLOptions:
    """The options `stages.rl` builds from params sections: `rl`, `rl_datasets`, this run's entry."""
    from stages.rl import rl_options

    shared = dict(rl or RL)
    params = {"seed": 0, "rl_datasets": shared.pop("datasets"), "rl": shared,
              "rl_runs": {"test_run": {**RUN, **run}}, "scaffold_curve": {"every": snapshot_every}}
    return rl_options(params, "test_run")


@pytest.fixture(scope="module")
def init_dir(tokenizer, tmp_path_factory) -> Path:
    """The tiny policy on disk, with layer weights redrawn at std 0.3 so sampling is not degenerate."""
    model = build_tiny_model(tokenizer, TINY)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in model.model.layers.parameters():
            if weight.ndim == 2:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.3)
    path = tmp_path_factory.mktemp("rl_init") / "base"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class ForkSomeRollouts:
    """Rollouts whose first sampled token id is a multiple of 3: 1 more token, `<Parallel>`, paths of 2 tokens
    (closed by `</Path>`), a 1-token summary, 2 tokens, EOS. Odd ones: EOS after 3 tokens. Tags and EOS
    are banned everywhere else."""

    def __init__(self, tokenizer) -> None:
        self.tags = TagIds.from_tokenizer(tokenizer)
        self.eos = tokenizer.eos_token_id
        self.special = [*astuple(self.tags), self.eos]
        self.turn = tokenizer.convert_tokens_to_ids("<|im_start|>")

    def wanted(self, generated: list[int]) -> int | None:
        marks = [i for i, token in enumerate(generated) if token in self.special]
        last = generated[marks[-1]] if marks else None
        since = len(generated) - (marks[-1] + 1 if marks else 0)
        t = self.tags
        if last is None and since == 2:
            return t.parallel_open if generated[0] % 3 == 0 else None
        rules = {None: (3, self.eos), t.path_open: (2, t.path_close), t.summary_open: (1, t.summary_close),
                 t.summary_close: (2, self.eos)}
        after, token = rules.get(last, (-1, None))
        return token if since == after else None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[:, self.special] = float("-inf")
        for row, sequence in enumerate(input_ids.tolist()):
            start = len(sequence) - sequence[::-1].index(self.turn) + 2  # after "<|im_start|>assistant\n"
            token = self.wanted(sequence[start:])
            if token is not None:
                scores[row] = float("-inf")
                scores[row, token] = 0.0
        return scores


# ---------------------------------------------------------------------------------- options


@pytest.mark.parametrize("batch, generations, micro, processes, expected", [
    (2, 4, 8, 1, (8, 1, 1, 8)),          # tiny: one micro-batch holds the whole step
    (1024, 5, 8, 8, (8, 80, 80, 5120)),  # GSM8K RL on 8 GPUs
    (512, 8, 8, 1, (8, 512, 512, 4096)),  # DAPO RL on one GPU
    (2, 4, 8, 2, (4, 1, 1, 8)),          # a micro-batch never exceeds a process's share
])
def test_b_prompts_times_g_rollouts_make_one_generation_and_one_update(batch, generations, micro, processes,
                                                                        expected, tmp_path):
    rl = {**RL, "per_device_batch_size": micro,
          "datasets": {"gsm8k": {"batch_size": batch, "num_generations": generations, "max_steps": 3}}}
    opts = options(rl)
    assert tuple(vars(batch_layout(opts, processes)).values()) == expected
    if processes == 1:
        config = grpo_config(opts, tmp_path)
        assert (config.per_device_train_batch_size, config.gradient_accumulation_steps,
                config.steps_per_generation, config.generation_batch_size) == expected
        assert config.num_generations == generations and config.num_iterations == 1
        assert (config.loss_type == "bnpo" and config.delta == 3.0 and config.beta == 0.0
                and not config.use_vllm)


def test_indivisible_batch_is_a_one_line_error():
    rl = {**RL, "per_device_batch_size": 4, "datasets": {"gsm8k": {"batch_size": 3, "num_generations": 2,
                                                                   "max_steps": 1}}}
    with pytest.raises(PipelineError, match="per_device_batch_size: 4 does not divide the 6 completions"):
        batch_layout(options(rl))
    with pytest.raises(PipelineError, match="6 completions do not split over 4 processes"):
        batch_layout(options(rl), processes=4)


def test_run_dataset_and_shared_sections_merge_into_options(tmp_path):
    opts = options(epsilon_high=0.28, variant="unseen", reward="alternating")
    assert (opts.batch_size, opts.num_generations, opts.max_steps) == (1, 4, 1)
    assert opts.structured and opts.max_completion_tokens == 24
    config = grpo_config(opts, tmp_path)
    assert (config.epsilon, config.epsilon_high, config.learning_rate) == (0.2, 0.28, 1.0e-3)
    # = epsilon
    assert options().epsilon_high is None and grpo_config(options(), tmp_path).epsilon_high is None


def test_vllm_engine_turns_on_trl_vllm_so_trl_syncs_its_weights(tmp_path):
    colocate = grpo_config(options({**RL, "engine": "vllm"}), tmp_path)
    assert colocate.use_vllm and colocate.vllm_mode == "colocate"
    assert colocate.vllm_max_model_length == RL["max_prompt_tokens"] + RL["max_completion_tokens"]
    server = grpo_config(options({**RL, "engine": "vllm", "vllm_mode": "server",
                                  "vllm_server_base_url": "http://10.0.0.2:8000"}), tmp_path)
    assert server.use_vllm and server.vllm_mode == "server" and server.vllm_server_base_url == "http://10.0.0.2:8000"
    with pytest.raises(PipelineError, match="rl.vllm_server_base_url: required with vllm_mode server"):
        grpo_config(options({**RL, "engine": "vllm", "vllm_mode": "server"}), tmp_path)
    if not torch.cuda.is_available():  # auto = vLLM only with CUDA (engine.resolve_engine)
        assert options({**RL, "engine": "auto"}).resolved_engine() == "transformers"


@pytest.mark.parametrize("run, message", [
    ({"colour": "red"}, "rl_runs.test_run: unknown key 'colour'"),
    ({"dataset": "math"}, "rl_runs.test_run.dataset: 'math' has no entry in rl_datasets"),
    ({"reward": "kindness"}, "rl_runs.test_run.reward: unknown schedule 'kindness'"),
    ({"variant": "hidden"}, "variant: expected one of 'seen', 'unseen'"),
    ({"lr": -1.0}, "params.yaml rl_runs.test_run.lr"),   # an override's error names the run's entry
    ({"num_generations": 8}, "rl_runs.test_run: unknown key 'num_generations'"),   # only RUN_OVERRIDES may
])
def test_bad_run_entry_is_a_one_line_error(run, message):
    with pytest.raises(PipelineError, match=message) as error:
        options(**run)
    assert "\n" not in str(error.value)


def test_a_run_entry_overrides_max_steps_and_lr_of_its_dataset_and_rl():
    assert (options().max_steps, options().lr) == (1, RL["lr"])
    assert (options(max_steps=12, lr=1e-4).max_steps, options(max_steps=12, lr=1e-4).lr) == (12, 1e-4)


def test_long_prompts_are_dropped_and_columns_kept_for_rewards(tokenizer):
    short = len(tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True))
    rows = [*PROBLEMS, {**PROBLEMS[0], "id": "long", "question": "seven " * 3000}]
    dataset, dropped = rl_dataset(rows, tokenizer, "baseline", max_prompt_tokens=short + 200)
    assert dropped == 1 and dataset["id"] == ["p1", "p2"]
    assert dataset["ground_truth"] == ["5", "19"] and dataset["answer_kind"] == ["gsm8k", "gsm8k"]
    assert dataset["prompt"][0] == [{"role": "user", "content": dataset["prompt"][0][0]["content"]}]
    assert dataset["prompt"][0][0]["content"].startswith("What is 2 + 3? Let's think step by step")
    with pytest.raises(PipelineError, match="no prompt fits rl.max_prompt_tokens = 5"):
        rl_dataset(rows, tokenizer, "parallel", max_prompt_tokens=5)


def test_step_records_carry_the_schedule_reward_type_and_null_positions():
    history = [{"step": s, "reward": 0.5, "accuracy": 0.25, "parallel_ratio": 1.0, "response_length": 9.0,
                "blocks_per_response": 1.0, **({"parallel_position": 0.4} if s != 2 else {})}
               for s in (1, 2, 3)]
    history.append({"step": 3, "train_runtime": 1.0})
    records = step_records(history, "alternating", RewardConfig(window=2, tiered_steps=1))
    assert [tuple(r) for r in records] == [STEP_KEYS] * 3
    assert [r["reward_type"] for r in records] == ["accuracy", "tiered", "accuracy"]
    assert [r["parallel_position"] for r in records] == [0.4, None, 0.4]


# ---------------------------------------------------------------------------------- structured log-probs


def trainer_for(structured: bool, init_dir: Path, tmp_path: Path) -> ParallelGRPOTrainer:
    model, tokenizer = load_model(init_dir, attn_implementation="sdpa")
    dataset, _ = rl_dataset(PROBLEMS, tokenizer, "parallel", 2000)
    return ParallelGRPOTrainer(model=model, reward_funcs=[build_reward("accuracy")],
                               args=grpo_config(options(), tmp_path / f"out_{structured}"),
                               train_dataset=dataset, processing_class=tokenizer, structured=structured)


def reference_logprobs(model, ids: torch.Tensor, tags: TagIds, structured: bool,
                       completion: int) -> torch.Tensor:
    """Log-prob of each of the last `completion` tokens from a plain forward with the given structure."""
    structure = build_structure(ids, None, tags, structured=structured)
    with torch.no_grad():
        logits = model(input_ids=ids, **attention_inputs(structure, "sdpa")).logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(2, ids[:, 1:, None])[..., 0]
    return logprobs[:, -completion:]


TWO_PATHS = ("Let me see.<Parallel><Path> add them</Path><Path> count up</Path></Parallel>\n"
             "<Summary> 5</Summary> Final Answer: 5")
NO_BLOCK = "Let me see. Two plus three is five. Final Answer: 5"


@pytest.fixture(scope="module")
def trainers(init_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainers")
    return {structured: trainer_for(structured, init_dir, tmp) for structured in (False, True)}


def encode(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    return (tokenizer.encode(prompt, add_special_tokens=False),
            tokenizer.encode(completion, add_special_tokens=False) + [tokenizer.eos_token_id])


def scored(trainer, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids),
                                                                 len(completion_ids))
    return logps[0]


def test_unseen_trainer_scores_paths_with_the_path_window_mask(trainers, tokenizer, tags):
    prompt, completion = encode(tokenizer, "What is 2 + 3?", TWO_PATHS)
    seen, unseen = scored(trainers[False], prompt, completion), scored(trainers[True], prompt, completion)
    ids = torch.tensor([prompt + completion])
    model = trainers[True].model
    assert torch.allclose(unseen, reference_logprobs(model, ids, tags, True, len(completion))[0], atol=1e-4)
    assert torch.allclose(seen, reference_logprobs(model, ids, tags, False, len(completion))[0], atol=1e-4)
    second_path = [i for i, t in enumerate(completion) if t == tags.path_open][1]
    # a token is scored from the position before it: up to the second <Path> both see the same context
    assert torch.allclose(seen[:second_path + 1], unseen[:second_path + 1], atol=1e-5)
    assert not torch.allclose(seen[second_path + 1:], unseen[second_path + 1:], atol=1e-3)


def test_unseen_trainer_equals_causal_without_blocks(trainers, tokenizer):
    prompt, completion = encode(tokenizer, "What is 2 + 3?", NO_BLOCK)
    assert torch.allclose(scored(trainers[False], prompt, completion),
                          scored(trainers[True], prompt, completion), atol=1e-5)


def test_unseen_scores_of_a_padded_batch_match_each_row_alone(trainers, tokenizer):
    """TRL's layout: left-padded prompts, right-padded completions (padding in the middle)."""
    rows = [encode(tokenizer, "What is 2 + 3?", TWO_PATHS),
            encode(tokenizer, "A much longer question here?", NO_BLOCK)]
    prompt_len, completion_len = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    pad = tokenizer.pad_token_id
    ids, mask = [], []
    for prompt, completion in rows:
        left, right = prompt_len - len(prompt), completion_len - len(completion)
        ids.append([pad] * left + prompt + completion + [pad] * right)
        mask.append([0] * left + [1] * (len(prompt) + len(completion)) + [0] * right)
    trainer = trainers[True]
    ids, mask = torch.tensor(ids), torch.tensor(mask)
    with torch.no_grad():
        batch, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, completion_len)
    for row, (prompt, completion) in enumerate(rows):
        alone = scored(trainer, prompt, completion)
        assert torch.allclose(batch[row, :len(completion)], alone, atol=1e-4)


def micro_batch(tokenizer, advantages: list[float]) -> dict:
    """A TRL training micro-batch of one completion per advantage (same prompt, same completion)."""
    prompt, completion = encode(tokenizer, "What is 2 + 3?", TWO_PATHS)
    rows = len(advantages)
    return {"prompt_ids": torch.tensor([prompt] * rows),
            "prompt_mask": torch.ones(rows, len(prompt), dtype=torch.long),
            "completion_ids": torch.tensor([completion] * rows),
            "completion_mask": torch.ones(rows, len(completion), dtype=torch.long),
            "advantages": torch.tensor(advantages),
            "num_items_in_batch": torch.tensor(float(rows * len(completion))),
            "old_per_token_logps": None}


def gradients(trainer, loss: torch.Tensor) -> list[torch.Tensor]:
    trainer.model.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.clone() for p in trainer.model.parameters() if p.requires_grad]


@pytest.mark.parametrize("structured", [False, True])
def test_zero_advantage_micro_batch_skips_the_forward_with_the_same_zero_gradient(trainers, tokenizer,
                                                                                  structured):
    trainer = trainers[structured]
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer.train sets before its first micro-batch
    zero = micro_batch(tokenizer, [0.0, 0.0])
    full = gradients(trainer, GRPOTrainer.compute_loss(trainer, trainer.model, zero))  # TRL's own loss
    assert all(torch.count_nonzero(g) == 0 for g in full)  # no KL, no entropy bonus: exactly zero
    skipped = trainer.skipped_micro_batches
    fast = gradients(trainer, trainer.compute_loss(trainer.model, zero))
    assert trainer.skipped_micro_batches == skipped + 1
    assert trainer._metrics["train"]["clip_ratio/region_mean"][-1] == 0.0  # logged as the full pass would
    # every parameter gets it
    assert len(fast) == len(full) and all(torch.count_nonzero(g) == 0 for g in fast)
    moving = gradients(trainer, trainer.compute_loss(trainer.model, micro_batch(tokenizer, [1.0, -1.0])))
    assert trainer.skipped_micro_batches == skipped + 1  # a spread is computed in full
    assert any(torch.count_nonzero(g) > 0 for g in moving)
    trainer.model.zero_grad(set_to_none=True)


def test_zero_advantages_are_computed_in_full_with_a_kl_term(trainers, tokenizer):
    trainer = trainers[False]
    trainer.model.train()
    trainer.beta = 0.04  # the KL term pulls towards the reference even at zero advantage
    try:
        assert not trainer._gradient_is_zero(trainer.model, micro_batch(tokenizer, [0.0, 0.0]))
    finally:
        trainer.beta = 0.0
    assert trainer._gradient_is_zero(trainer.model, micro_batch(tokenizer, [0.0, 0.0]))
    trainer.model.eval()  # TRL's evaluation loss is a measurement, never skipped
    try:
        assert not trainer._gradient_is_zero(trainer.model, micro_batch(tokenizer, [0.0, 0.0]))
    finally:
        trainer.model.train()


class SpreadIn:
    """A reward with a spread (+1, -1, ...) in the groups of the named prompts, 0 everywhere else."""

    __name__ = "spread_in"

    def __init__(self) -> None:
        self.ids: set[str] = set()

    def __call__(self, prompts, completions, id, **kwargs) -> list[float]:
        return [(1.0 if index % 2 else -1.0) if problem in self.ids else 0.0
                for index, problem in enumerate(id)]


@pytest.mark.parametrize("structured", [False, True])
def test_a_step_keeps_groups_in_order_and_scores_old_logprobs_only_for_later_updates_with_a_spread(
        init_dir, tokenizer, tmp_path, structured):
    """2 prompts x 4 rollouts, 2 updates of 1 prompt, micro-batches of 2: the 4 micro-batches hold the groups
    in rollout order (the first update one prompt's 4 rollouts, the second the other's); only a second-update
    micro-batch whose group has a spread gets old log-probs, equal to TRL's own scoring of the whole batch."""
    from parallel_r1.training.grpo import rollout_function_for

    opts = options(rl={**RL, "per_device_batch_size": 2,
                       "datasets": {"gsm8k": {"batch_size": 2, "mini_batch_size": 1, "num_generations": 4,
                                              "max_steps": 1}}}, variant="unseen" if structured else "seen")
    model, _ = load_model(init_dir, attn_implementation="sdpa")
    dataset, _ = rl_dataset(PROBLEMS, tokenizer, "parallel", 2000)
    reward = SpreadIn()
    trainer = ParallelGRPOTrainer(
        model=model, reward_funcs=[reward], args=grpo_config(opts, tmp_path / "out"), train_dataset=dataset,
        processing_class=tokenizer, structured=structured,
        rollout_func=rollout_function_for(opts, "transformers", tokenizer,
                                          logits_processor=ForkSomeRollouts(tokenizer)))
    assert trainer._in_order_applies() and trainer.args.steps_per_generation == 4
    trainer.model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    groups = [row["id"] for row in batch]
    assert groups == [groups[0]] * 4 + [groups[4]] * 4 and groups[0] != groups[4]  # TRL's sampler: G together

    def prepared() -> list[dict]:
        trainer._step, trainer._buffered_inputs = 0, None
        trainer._prepare_inputs(batch)
        return trainer._buffered_inputs

    reward.ids = {groups[0]}   # the first update's group only: no old log-probs at all
    chunks = prepared()
    assert [bool((chunk["advantages"] != 0).any()) for chunk in chunks] == [True, True, False, False]
    assert all(chunk["old_per_token_logps"] is None for chunk in chunks)
    prompts = [chunk["prompt_ids"] for chunk in chunks]
    assert torch.equal(prompts[0], prompts[1]) and torch.equal(prompts[2], prompts[3])
    assert not torch.equal(prompts[0][0], prompts[2][0])

    reward.ids = set(groups)   # a spread everywhere: the second update's two micro-batches are scored
    scored_before = trainer.old_logps_scored
    chunks = prepared()
    assert [chunk["old_per_token_logps"] is None for chunk in chunks] == [True, True, False, False]
    assert trainer.old_logps_scored == scored_before + 2
    ids = torch.cat([torch.cat([c["prompt_ids"], c["completion_ids"]], dim=1) for c in chunks])
    mask = torch.cat([torch.cat([c["prompt_mask"], c["completion_mask"]], dim=1) for c in chunks])
    with torch.no_grad():   # TRL's own scoring: the whole generation batch in chunks of the micro-batch
        whole, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, chunks[0]["completion_ids"].size(1), batch_size=2)
    assert torch.equal(torch.cat([chunks[2]["old_per_token_logps"], chunks[3]["old_per_token_logps"]]),
                       whole[4:])
    trainer.beta = 0.04   # a KL term reads the reference, not only the ratio: TRL's own path
    assert not trainer._in_order_applies()


# ---------------------------------------------------------------------------------- end to end


def run_once(init_dir: Path, tmp_path: Path, tokenizer, opts: RLOptions, reward_config=RewardConfig(),
             **kwargs):
    return train_rl(opts, init_dir, PROBLEMS, tmp_path / "models" / opts.run,
                    tmp_path / "checkpoints" / opts.run, reward_config=reward_config,
                    engine_options={"logits_processor": ForkSomeRollouts(tokenizer)}, **kwargs)


def changed_parameters(before: Path, after: Path) -> int:
    old, _ = load_model(before)
    new, _ = load_model(after)
    return sum(not torch.equal(a, b)
               for a, b in zip(old.state_dict().values(), new.state_dict().values(), strict=False))


@pytest.mark.slow
def test_seen_grpo_step_forks_rollouts_rewards_them_and_saves_the_model(init_dir, tmp_path, tokenizer):
    # 2 micro-batches
    rl = {**RL, "datasets": {"gsm8k": {"batch_size": 2, "num_generations": 4, "max_steps": 1}}}
    result = run_once(init_dir, tmp_path, tokenizer, options(rl))
    assert result.steps == 1 and result.steps_this_run == 1 and result.resumed_from is None
    (record,) = result.history
    assert tuple(record) == STEP_KEYS and record["reward_type"] == "parallel_only"
    assert 0.0 < record["parallel_ratio"] < 1.0  # some rollouts forked, some did not
    assert record["reward"] == pytest.approx(2 * record["parallel_ratio"] - 1)  # parallel_only: +1 / -1
    assert record["blocks_per_response"] == pytest.approx(record["parallel_ratio"])
    assert 0.0 < record["parallel_position"] < 0.5
    assert result.rollout.tokens > 0 and result.engine == "transformers"
    split = result.step_times  # the step's time: rollout, then TRL's scoring, then the update
    assert split["rollout_seconds"] == pytest.approx(result.rollout.seconds, abs=0.01)
    assert split["scoring_seconds"] >= 0 and split["update_seconds"] > 0  # scoring: ~0 s with beta 0
    assert sum(split.values()) <= result.train_seconds + 0.05  # the three parts of the trainer's time
    assert changed_parameters(init_dir, result.model_dir) > 0  # mixed rewards -> a real update
    _, saved = load_model(result.model_dir)
    assert TagIds.from_tokenizer(saved) == TagIds.from_tokenizer(tokenizer)
    assert not (tmp_path / "checkpoints" / "test_run").exists()


@pytest.mark.slow
class AdamStepCount(TrainerCallback):
    """AdamW's step count after each optimizer update (callbacks run after the trainer's own)."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        inner = optimizer
        while not isinstance(inner, torch.optim.Optimizer):
            inner = inner.optimizer
        self.counts.append(int(next(iter(inner.state.values()))["step"]))


def test_unseen_scaffold_run_exports_step_snapshots(init_dir, tmp_path, tokenizer):
    opts = options(variant="unseen", reward="scaffold", epsilon_high=0.28, snapshots=True, snapshot_every=1,
                   rl={**RL, "datasets": {"gsm8k": {"batch_size": 1, "num_generations": 4, "max_steps": 2}}})
    every_step_tiered_then_switch = RewardConfig(window=1, tiered_steps=1, switch_step=1)
    adam_steps = AdamStepCount()
    result = run_once(init_dir, tmp_path, tokenizer, opts, every_step_tiered_then_switch,
                      callbacks=[adam_steps])
    assert [r["reward_type"] for r in result.history] == ["tiered", "accuracy"]
    assert adam_steps.counts == [0, 1]  # the switch after step 1 restarted the optimizer (no switch: [1, 2])
    assert result.snapshots == ["step-1", "step-2"]
    for name in result.snapshots:
        model, _ = load_model(result.model_dir / "steps" / name)
        assert model.config.num_hidden_layers == 1
    assert all(r["parallel_ratio"] is not None for r in result.history)


def assert_same_history(history: list[dict], expected: list[dict], rel: float = 1e-4) -> None:
    """Step records equal: numbers within `rel`, everything else exactly."""
    assert len(history) == len(expected)
    for record, wanted in zip(history, expected, strict=True):
        assert record.keys() == wanted.keys()
        for key, value in wanted.items():
            if isinstance(value, float):
                assert record[key] == pytest.approx(value, rel=rel, abs=1e-6), (record["step"], key)
            else:
                assert record[key] == value, (record["step"], key)


# The seeded 3-step Unseen run's (reward, response_length, parallel_ratio, reward_std) per step: a change
# to sampling, rewards or the update shows up here (as torchtune's recipe tests pin their losses).
PINNED_KEYS = ("reward", "response_length", "parallel_ratio", "reward_std")
PINNED_UNSEEN_GRPO_HISTORY = [(1.0, 19.0, 1.0, 0.0), (-0.5, 7.75, 0.25, 1.0), (0.0, 11.5, 0.5, 1.1547)]


def test_prompt_order_depends_only_on_seed_and_epoch():
    """A sampler restarted at epoch 2 (a resume) yields the order an uninterrupted one yields there."""
    def sampler():
        return EpochSeededRepeatSampler(list(range(10)), mini_repeat_count=2, batch_size=2, seed=7)

    uninterrupted = sampler()
    orders = []
    for epoch in range(3):
        uninterrupted.set_epoch(epoch)
        orders.append(list(uninterrupted))
    restarted = sampler()
    restarted.set_epoch(2)
    assert list(restarted) == orders[2]
    assert orders[0] != orders[1] != orders[2]  # each epoch still reshuffles
    assert sorted(orders[1]) == sorted(i for i in range(10) for _ in range(2))


class SavedSteps(TrainerCallback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_save(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


class KillAtStep2(TrainerCallback):
    """Stops the run like a kill, right after the step-2 checkpoint is written."""

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 2:
            raise KeyboardInterrupt("killed")


@pytest.mark.slow
def test_killed_run_resumes_from_its_last_checkpoint_with_the_uninterrupted_history(init_dir, tmp_path,
                                                                                    tokenizer):
    def steps(n):
        return options({**RL, "datasets": {"gsm8k": {"batch_size": 1, "num_generations": 4, "max_steps": n}}},
                       variant="unseen")

    saves = SavedSteps()
    uninterrupted = run_once(init_dir, tmp_path / "uninterrupted", tokenizer, steps(3), callbacks=[saves])
    assert saves.steps == [1, 2]  # every save_steps (1), but the last: the final model is saved instead
    pinned = [value for step in PINNED_UNSEEN_GRPO_HISTORY for value in step]
    assert [r[k] for r in uninterrupted.history for k in PINNED_KEYS] == pytest.approx(pinned, rel=1e-3)
    with pytest.raises(KeyboardInterrupt):  # (no checkpoint is written at a run's last step)
        run_once(init_dir, tmp_path, tokenizer, steps(4), callbacks=[KillAtStep2()])
    checkpoints = tmp_path / "checkpoints" / "test_run"
    assert (checkpoints / "checkpoint-2").is_dir() and not (tmp_path / "models" / "test_run").exists()

    result = run_once(init_dir, tmp_path, tokenizer, steps(3))  # max_steps is not part of the run's identity
    assert result.resumed_from == str(checkpoints / "checkpoint-2")
    assert (result.steps, result.steps_this_run) == (3, 1)
    assert (result.model_dir / "model.safetensors").is_file() and not checkpoints.exists()
    # the resumed step samples, scores and updates as the uninterrupted run's step 3 did
    assert_same_history(result.history, uninterrupted.history)
    assert changed_parameters(uninterrupted.model_dir, result.model_dir) == 0
    # what the reports read (summary.json beside steps.json) does not say it was resumed: they stay up to date
    from stages.rl import runtime, summarize

    whole, resumed = summarize("test_run", steps(3), uninterrupted), summarize("test_run", steps(3), result)
    assert resumed.keys() == whole.keys()
    for key, value in whole.items():
        assert resumed[key] == (pytest.approx(value, rel=1e-4) if isinstance(value, float) else value), key
    ran = runtime(result, 1.0)
    assert (ran["resumed_from"], ran["steps_this_run"]) == (result.resumed_from, 1)


# ---------------------------------------------------------------------------------- stage


def stage_project(root: Path, with_model: Path | None = None) -> None:
    """A project folder with the repository's params.yaml and prompt sets (and an init model)."""
    write_profile_params(root, "tiny")  # on the fast random-init profile
    for name in ("gsm8k", "dapo"):
        write_jsonl(root / f"data/rl/{name}.jsonl", PROBLEMS)
    if with_model is not None:
        shutil.copytree(with_model, root / "models" / "base")


def run_stage(root: Path, monkeypatch, capsys, *args: str) -> str:
    from stages import rl as stage

    monkeypatch.chdir(root)
    monkeypatch.setenv("PARALLEL_R1_TRACKING", "off")
    with pytest.raises(SystemExit) as exit_info:
        stage.main(list(args))
    assert exit_info.value.code == 1
    return capsys.readouterr().err.strip()


def test_unknown_run_name_stops_with_one_line(tmp_path, monkeypatch, capsys):
    stage_project(tmp_path)
    err = run_stage(tmp_path, monkeypatch, capsys, "grpo_everything")
    assert err.startswith("error: usage: python -m stages.rl <run> (one of grpo_gsm8k, ") and "\n" not in err


def test_missing_init_model_stops_with_one_line(tmp_path, monkeypatch, capsys):
    stage_project(tmp_path)
    err = run_stage(tmp_path, monkeypatch, capsys, "grpo_gsm8k")
    assert err.startswith("error: params.yaml rl_runs.grpo_gsm8k.init: 'base' is not written yet "
                          "(run its stage first): models/base not found (known: base, ") and "\n" not in err


def test_corrupt_init_model_stops_with_one_line(tmp_path, monkeypatch, capsys, init_dir):
    stage_project(tmp_path, with_model=init_dir)
    (tmp_path / "models/base/model.safetensors").unlink()
    err = run_stage(tmp_path, monkeypatch, capsys, "grpo_gsm8k")
    assert err == "error: models/base: no weights (*.safetensors) — corrupt or half-written checkpoint"


def nudge_one_weight(folder: Path) -> None:
    model, _ = load_model(folder)
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-3
    model.save_pretrained(folder)


def test_a_runs_memo_key_ignores_its_names_but_not_what_it_trains_on(init_dir, tmp_path):
    from parallel_r1.training import run_memo
    from stages.profiles import compose
    from stages.rl import reward_config, rl_options

    params = compose(REPO, "tiny")

    def key(run: str, rows=PROBLEMS, init: Path = init_dir, **changes) -> str | None:
        chosen = dataclasses.replace(rl_options(params, run), **changes)
        return run_memo.run_key(chosen, rows, init, reward_config(params, chosen.reward), "float32")

    # grpo_gsm8k_then_dapo differs from grpo_dapo in its name and its init's name only
    assert key("grpo_dapo") == key("grpo_gsm8k_then_dapo") == key("grpo_dapo", save_steps=9) is not None
    assert key("grpo_dapo", max_steps=9) != key("grpo_dapo") != key("grpo_dapo", lr=3e-6)
    assert key("grpo_dapo", rows=PROBLEMS[:1]) != key("grpo_dapo")
    assert key("parallel_r1_unseen_s1") != key("parallel_r1_unseen_parallel_only")  # rewards differ
    moved = tmp_path / "moved"
    shutil.copytree(init_dir, moved)
    nudge_one_weight(moved)
    assert key("grpo_dapo", init=moved) != key("grpo_dapo")
    assert key("scaffold") is None  # its step snapshots are not memoised


@pytest.mark.slow
def test_stage_writes_model_steps_and_summary_and_an_equal_run_reuses_them(
        tmp_path, monkeypatch, capsys, init_dir):
    from parallel_r1.weights_digest import model_digest
    from stages import rl as stage

    stage_project(tmp_path, with_model=init_dir)
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    params["rl"].update({"max_completion_tokens": 8, "save_steps": 5})
    params["rl_datasets"]["dapo"].update({"batch_size": 1, "num_generations": 2, "max_steps": 1})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    shutil.copytree(init_dir, tmp_path / "models/grpo_gsm8k")  # a GRPO on GSM8K that moved no weight
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("PARALLEL_R1_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "rl-memo-test")
    metrics, runtime = tmp_path / "metrics/rl", tmp_path / "metrics/runtime/rl"
    stage.main(["grpo_dapo"])
    trained_steps = read_json(metrics / "grpo_dapo/steps.json")
    assert [tuple(r) for r in trained_steps] == [STEP_KEYS] and trained_steps[0]["reward_type"] == "accuracy"
    trained_summary = read_json(metrics / "grpo_dapo/summary.json")
    assert trained_summary["steps"] == 1 and trained_summary["rollout_backend"] == "transformers"
    # TRL's per-step reward spread reaches steps.json
    assert 0 <= trained_steps[0]["frac_reward_zero_std"] <= 1
    assert trained_summary["steps_with_reward_spread"] == int(trained_steps[0]["frac_reward_zero_std"] < 1)
    # speed and resume facts live apart from the summary the reports read
    trained_runtime = read_json(runtime / "grpo_dapo.json")
    # one micro-batch (2 rollouts of 1 prompt): skipped exactly when the group had no spread
    assert (trained_runtime["skipped_micro_batches_this_run"]
            == 1 - trained_summary["steps_with_reward_spread"])
    assert trained_runtime["rollout_tokens_per_s"] > 0 and trained_runtime["reused_from"] is None
    assert trained_summary["final_reward"] == trained_steps[0]["reward"]
    assert set(trained_runtime["step_time_split"]) == {"rollout_seconds", "scoring_seconds", "update_seconds"}
    assert trained_summary["profile"] == "tiny"
    assert not set(trained_summary) & set(trained_runtime)
    load_model(tmp_path / "models/grpo_dapo")
    trained = model_digest(tmp_path / "models/grpo_dapo")
    capsys.readouterr()

    stage.main(["grpo_gsm8k_then_dapo"])
    assert "rl@grpo_gsm8k_then_dapo: the same run as rl@grpo_dapo " in capsys.readouterr().out
    summary = read_json(metrics / "grpo_gsm8k_then_dapo/summary.json")
    assert (summary["init"], summary["run"]) == ("grpo_gsm8k", "grpo_gsm8k_then_dapo")
    # the reports' input is the trained run's but for the names: reports hash as a trained run's
    assert {**summary, "run": "grpo_dapo", "init": "base"} == trained_summary
    reused_runtime = read_json(runtime / "grpo_gsm8k_then_dapo.json")
    assert reused_runtime["reused_from"] == "grpo_dapo" and reused_runtime["steps_this_run"] == 0
    assert summary["steps"] == 1
    assert read_json(metrics / "grpo_gsm8k_then_dapo/steps.json") == trained_steps
    assert model_digest(tmp_path / "models/grpo_gsm8k_then_dapo") == trained
    assert read_json(tmp_path / "models/grpo_gsm8k_then_dapo/rollout.json")["prompt"] == "baseline"
    # its MLflow run holds the trained run's step metrics, as the Trainer logged them, and names it
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = {run.info.run_name: run for run in client.search_runs(
        [client.get_experiment_by_name("rl-memo-test").experiment_id])}
    trained_run, reused_run = runs["rl@grpo_dapo (accuracy)"], runs["rl@grpo_gsm8k_then_dapo (accuracy)"]
    assert reused_run.data.tags["reused_from"] == "grpo_dapo" and "reused_from" not in trained_run.data.tags
    # (TRL's profiling timers go to MLflow straight, outside the log history: the time this run took is its
    # own), nor is the trained run's mean step time, which the reused run did not take
    trained_keys = {key for key in trained_run.data.metrics if not key.startswith("profiling/")}
    assert trained_keys - {"mean_step_seconds"} == set(reused_run.data.metrics) and "reward" in trained_keys
    assert [(m.step, m.value) for m in client.get_metric_history(reused_run.info.run_id, "reward")] == [
        (m.step, m.value) for m in client.get_metric_history(trained_run.info.run_id, "reward")]

    # once grpo_dapo's folder holds other weights it is no longer reused, and training gives the same
    nudge_one_weight(tmp_path / "models/grpo_dapo")
    stage.main(["grpo_gsm8k_then_dapo"])
    assert "the same run as" not in capsys.readouterr().out
    assert read_json(runtime / "grpo_gsm8k_then_dapo.json")["reused_from"] is None
    assert {**read_json(metrics / "grpo_gsm8k_then_dapo/summary.json"), "run": "grpo_dapo",
            "init": "base"} == trained_summary
    assert_same_history(read_json(metrics / "grpo_gsm8k_then_dapo/steps.json"), trained_steps)
    assert model_digest(tmp_path / "models/grpo_gsm8k_then_dapo") == trained


@pytest.mark.skipif(not vllm_available(), reason="vLLM not installed: TRL has nothing to import")
def test_a_transformers_run_keeps_trl_from_importing_vllm():
    """TRL imports vLLM whenever installed; a run that does not use it skips that start-up cost."""
    import subprocess
    import sys

    code = ("import sys; from parallel_r1.training.grpo import _keep_trl_off_vllm; _keep_trl_off_vllm(); "
            "from parallel_r1.training.grpo_trainer import ParallelGRPOTrainer; print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "False"


def test_unseen_runs_can_pick_their_own_engine():
    """rl.unseen_engine: Unseen runs choose exact (transformers) or fast (vllm) decoding; Seen runs and
    "same" keep rl.engine; an unknown name is a one-line error naming the param."""
    exact = {**RL, "engine": "vllm", "unseen_engine": "transformers"}
    assert options(exact, variant="unseen").resolved_engine() == "transformers"
    assert options(exact, variant="seen").resolved_engine() == "vllm"
    assert options({**RL, "unseen_engine": "same"}, variant="unseen").resolved_engine() == "transformers"
    with pytest.raises(PipelineError, match="rl.unseen_engine: .*'fast'") as error:
        options({**RL, "unseen_engine": "fast"}, variant="unseen")
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------------- the official loss


def fixed_batch() -> tuple[dict, torch.Tensor]:
    """Two completions (3 and 2 tokens), advantages +1 / -2, old log-probs 0 so the ratio is exp(log-prob):
    ratios 1.5, 0.5, 1.1 and 4.0, 0.9 (the third token of row 2 is padding)."""
    ratios = torch.tensor([[1.5, 0.5, 1.1], [4.0, 0.9, 2.0]])
    inputs = {"prompt_ids": torch.zeros(2, 1, dtype=torch.long),
              "prompt_mask": torch.ones(2, 1, dtype=torch.long),
              "completion_ids": torch.zeros(2, 3, dtype=torch.long),
              "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
              "advantages": torch.tensor([1.0, -2.0]),
              "old_per_token_logps": torch.zeros(2, 3), "num_items_in_batch": torch.tensor(10.0)}
    return inputs, ratios.log().requires_grad_()


def loss_and_grad(trainer, monkeypatch, loss_type: str,
                  delta: float | None) -> tuple[float, torch.Tensor | None]:
    inputs, logps = fixed_batch()
    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies",
                        lambda *args, **kwargs: (logps, torch.zeros_like(logps), None))
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    monkeypatch.setattr(trainer.args, "delta", delta)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2  # this micro-batch is one of 2 in the update
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.item(), logps.grad


def test_grpo_defaults_are_the_official_loss_dual_clip_and_weight_decay(trainers):
    trainer = trainers[False]  # built by grpo_config(options())
    assert (trainer.loss_type, trainer.args.delta, trainer.args.weight_decay) == ("bnpo", 3.0, 0.01)
    with pytest.raises(PipelineError, match=r"params.yaml rl.dual_clip: 1.1 must exceed 1 \+ the upper clip"):
        options(rl={**RL, "dual_clip": 1.1})


def test_official_loss_is_a_token_mean_per_micro_batch_over_the_accumulation_steps(trainers, monkeypatch):
    """VERL (dp_actor.update_policy + core_algos.compute_policy_loss, token-mean, clip_ratio_c 3), by hand:
    row 1 (A = +1): -min(r, clip(r)) = -1.2, -0.5, -1.1;
    row 2 (A = -2): min(3 * 2, max(2r, 2 clip(r))) = min(6, 8) = 6 for r = 4 (dual-clip), 1.8 for r = 0.9;
    token mean of the micro-batch 5.0 / 5 tokens, divided by 2 accumulation steps = 0.5.
    Gradient wrt each log-prob (= d loss / d r * r): 0 where a clip binds (r = 1.5 high, r = 4 dual),
    -r / 10 for row 1's others, +2r / 10 for row 2's r = 0.9, 0 on padding."""
    loss, grad = loss_and_grad(trainers[False], monkeypatch, "bnpo", 3.0)
    assert loss == pytest.approx(0.5, abs=1e-6)
    expected = torch.tensor([[0.0, -0.5, -1.1], [0.0, 1.8, 0.0]]) / 10
    assert torch.allclose(grad, expected, atol=1e-6)


def test_without_dual_clip_the_negative_advantage_ratio_is_unbounded(trainers, monkeypatch):
    loss, grad = loss_and_grad(trainers[False], monkeypatch, "bnpo", None)
    assert loss == pytest.approx((-2.8 + 8.0 + 1.8) / 5 / 2, abs=1e-6)  # r = 4 now costs 2 x 4
    assert grad[1, 0].item() == pytest.approx(8.0 / 10, abs=1e-6)


def test_trl_dapo_form_divides_by_the_whole_generation_batchs_tokens(trainers, monkeypatch):
    """TRL's "dapo" (the former setting): the micro-batch's summed loss over num_items_in_batch (10 tokens in
    the whole generation batch) x accumulation steps / steps_per_generation -- not a per-micro-batch mean."""
    trainer = trainers[False]
    loss, _ = loss_and_grad(trainer, monkeypatch, "dapo", 3.0)
    assert loss == pytest.approx(5.0 / (10 * 2 / trainer.args.steps_per_generation), abs=1e-6)


def test_zero_advantage_skip_fails_closed_when_trl_renames_what_it_reads(trainers, tokenizer, monkeypatch):
    trainer = trainers[False]
    trainer.model.train()
    batch = micro_batch(tokenizer, [0.0, 0.0])
    assert trainer._gradient_is_zero(trainer.model, batch)
    monkeypatch.delattr(trainer, "_entropy_bonus_enabled")  # a TRL rename: unknown, so computed in full
    assert not trainer._gradient_is_zero(trainer.model, batch)
    monkeypatch.undo()
    monkeypatch.setattr(trainer.args, "entropy_coef", 0.01)
    assert not trainer._gradient_is_zero(trainer.model, batch)
    monkeypatch.undo()
    monkeypatch.setattr(trainer, "loss_type", "some_new_loss")
    assert not trainer._gradient_is_zero(trainer.model, batch)


def test_a_runs_memo_key_follows_the_machines_decode_dtype_and_cpu_kernels(init_dir, monkeypatch):
    import parallel_r1.models
    import parallel_r1.training.grpo
    import parallel_r1.weights_digest
    from parallel_r1.training.run_memo import run_key

    opts, rewards = options(), RewardConfig()
    key = run_key(opts, PROBLEMS, init_dir, rewards, "bfloat16")
    assert key == run_key(opts, PROBLEMS, init_dir, rewards, "bfloat16")
    native = parallel_r1.models.runs_in_bf16("bfloat16")
    for module in (parallel_r1.models, parallel_r1.training.grpo):  # the other CPU: bf16 native or not
        monkeypatch.setattr(module, "runs_in_bf16", lambda dtype: not native)
    assert run_key(opts, PROBLEMS, init_dir, rewards, "bfloat16") != key
    monkeypatch.undo()
    here = parallel_r1.weights_digest.device_kernels()
    other = "cpu:AVX512:bf16" if here == "cpu:AVX2:no-bf16" else "cpu:AVX2:no-bf16"  # not this machine's
    monkeypatch.setattr(parallel_r1.weights_digest, "device_kernels", lambda: other)
    assert run_key(opts, PROBLEMS, init_dir, rewards, "bfloat16") != key
