"""A GRPO step's micro-batches in rollout order, and old log-probs only where an update reads them.

TRL 1.16 shuffles each generation batch before splitting it into micro-batches, and scores the old
policy's log-probs of every completion before the rewards are known. Two consequences on a model whose
accuracy reward has a spread in few groups (the small profile: 1-2 groups of 4 per step):
  - a group without a spread (every advantage 0) is scattered over micro-batches that hold other groups,
    so the zero-advantage skip (`ParallelGRPOTrainer.compute_loss`) rarely fires and the update costs
    a forward and backward of nearly every completion;
  - the old log-probs are a forward of every completion, though the first update never reads them
    (nothing has changed the policy yet: TRL then takes the current log-probs, a ratio of 1) and a
    zero-advantage completion's loss is 0 whatever its ratio.

`InOrderGRPOTrainer` splits the batch in the order TRL's sampler and the rollout function give it, each
prompt's G completions side by side (VERL's actor also splits its batch in order: `dp_actor.update_policy`
has no shuffle), so a micro-batch of whole groups without a spread is skipped; and scores the old log-probs
after the advantages, only for the micro-batches of the second and later updates of a step, skipping those
whose every advantage is 0 where the trainer skips them. Each scored micro-batch gets the values TRL's own
scoring gives it (the same rows, padding and chunk size). It applies where the old log-probs serve only
the clip ratio: one PPO iteration, no KL reference, text only, no vLLM importance sampling; elsewhere TRL's
own path runs.
"""

from __future__ import annotations

from typing import Any

import torch
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import split_tensor_dict


class InOrderGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with in-order micro-batches and deferred old log-probs (see the module doc).

    A subclass that skips zero-advantage micro-batches says so in `_skips_are_exact()`; then their old
    log-probs are not scored either.
    """

    _buffered_inputs: list[dict[str, Any]] | None  # TRL's: the step's micro-batches (set in its __init__)
    _deferred_old_logps: list[tuple[tuple, dict]] | None = None
    _scoring_deferred = False  # while the deferred old log-probs are scored (per-call metrics skip them)
    old_logps_scored = 0  # micro-batches whose old log-probs were scored (this process's run)

    def _in_order_applies(self) -> bool:
        """Whether the old log-probs serve only the clip ratio of later updates (see the module doc)."""
        corrected = getattr(self, "use_vllm", True) and getattr(self, "vllm_importance_sampling_correction",
                                                                True)
        return (getattr(self, "num_iterations", None) == 1 and getattr(self, "beta", None) == 0.0
                and not corrected and not getattr(self, "_is_vlm", True))

    def _prepare_inputs(self, generation_batch: dict[str, Any]) -> dict[str, Any]:
        """TRL's `_prepare_inputs` for training, without its shuffle and with the old log-probs deferred."""
        if not (self.model.training and self._in_order_applies()):
            return super()._prepare_inputs(generation_batch)
        steps = self.args.steps_per_generation
        if self._step % (steps * self.num_iterations) == 0 or self._buffered_inputs is None:
            deferred: list[tuple[tuple, dict]] = []
            self._deferred_old_logps = deferred
            try:
                batch = self._generate_and_score_completions(generation_batch)
            finally:
                self._deferred_old_logps = None
            chunks = split_tensor_dict(batch, steps)
            self._score_old_logps(chunks, deferred)
            self._buffered_inputs = chunks
        return self._buffered_inputs[self._step % steps]

    def _score_old_logps(self, chunks: list[dict[str, Any]], deferred: list[tuple[tuple, dict]]) -> None:
        """Old log-probs for the micro-batches of the second and later updates that have a spread (all of
        them where skipping is not exact: every process then makes the same forwards). With one update a
        step TRL scores none (the ratio is 1) and neither does this."""
        later = len(chunks) > self.args.gradient_accumulation_steps
        if len(deferred) != int(later):
            raise RuntimeError(f"expected TRL to score the old log-probs {int(later)} time(s) per generation "
                               f"batch, not {len(deferred)} (TRL version?)")
        if not later:
            return
        (model, input_ids, attention_mask, logits_to_keep, *rest), options = deferred[0]
        size = len(input_ids) // len(chunks)
        every_later = not self._skips_are_exact()
        self._scoring_deferred = True
        try:
            for index, chunk in enumerate(chunks):
                needed = index >= self.args.gradient_accumulation_steps and (
                    every_later or bool((chunk["advantages"] != 0).any()))
                if not needed:
                    chunk["old_per_token_logps"] = None
                    continue
                rows = slice(index * size, (index + 1) * size)
                with torch.no_grad(), disable_gradient_checkpointing(self.model,
                                                                     self.args.gradient_checkpointing_kwargs):
                    chunk["old_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                        model, input_ids[rows], attention_mask[rows], logits_to_keep, *rest, **options)
                self.old_logps_scored += 1
        finally:
            self._scoring_deferred = False

    def _skips_are_exact(self) -> bool:
        """Whether a zero-advantage micro-batch is skipped, hence needs no old log-probs: not here."""
        return False

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args,
                                           **kwargs):
        """While a generation batch is scored in order, TRL's old log-prob call is recorded, not run."""
        if self._deferred_old_logps is not None and model is self.model and not torch.is_grad_enabled():
            call = (model, input_ids, attention_mask, logits_to_keep, *args)
            self._deferred_old_logps.append((call, kwargs))
            return None, None, None
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
