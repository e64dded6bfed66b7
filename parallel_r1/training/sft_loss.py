"""SFT with the official per-sequence loss: each sequence's token mean, averaged over sequences.

The authors' SFT trainer (VERL `fsdp_parallel_sft_trainer.py`, run with micro_batch_size_per_gpu=1)
takes the token mean of one sequence's response loss per micro-batch, divides it by the micro-batches
of the update and lets data parallelism average the processes: every sequence weighs the same, a
short answer's tokens more than a long one's. TRL's SFTTrainer divides the summed token losses by
the token count of the whole update instead (every token weighs the same). `SequenceMeanSFTTrainer`
keeps TRL's forward, metrics (entropy, token accuracy, token counts) and collator and only replaces
the number that is back-propagated: it reads the per-token log-probs of TRL's own forward (captured
by a forward hook, so there is no second forward) and returns the per-sequence mean, already divided
by the update's micro-batches (`loss_is_scaled_for_ga`).
"""

from __future__ import annotations

import torch
from trl import SFTTrainer

from parallel_r1.errors import PipelineError


def sequence_mean_loss(log_probs: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
    """Mean over sequences of each sequence's mean negative log-likelihood over its trained tokens.

    `log_probs` [B, T] (0 where not trained), `label_mask` [B, T]. A sequence without a trained token
    counts as 0, as in the official trainer (its sum over 0 + 1e-8 tokens)."""
    per_sequence = (-log_probs * label_mask).sum(-1) / label_mask.sum(-1).clamp(min=1)
    return per_sequence.mean()


class SequenceMeanSFTTrainer(SFTTrainer):
    """SFTTrainer whose loss is `sequence_mean_loss` per micro-batch / gradient-accumulation steps."""

    loss_is_scaled_for_ga = True  # transformers' Trainer: do not divide by the accumulation steps again

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # transformers < 5.19 has no `loss_is_scaled_for_ga`; TRL 1.16 then stores a *string* in
        # `compute_loss_func` to stop the Trainer's division, and SFTTrainer.compute_loss calls it
        # ("'str' object is not callable", seen on a GPU image with transformers 5.17). There the
        # Trainer divides by the accumulation steps itself, so this loss must not.
        self._divides_by_accumulation = not isinstance(self.compute_loss_func, str)
        if not self._divides_by_accumulation:
            self.compute_loss_func = None
            self.loss_is_scaled_for_ga = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        captured: list = []
        handle = model.register_forward_hook(lambda module, args, output: captured.append(output))
        try:
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            handle.remove()
        outputs = captured[0] if captured else None
        if getattr(outputs, "log_probs", None) is None or getattr(outputs, "label_mask", None) is None:
            raise PipelineError("sft.loss_normalization sequence: TRL's forward returned no per-token "
                                "log_probs / label_mask (label smoothing, compute_loss_func and sequence "
                                "parallelism are not supported with it)")
        loss = sequence_mean_loss(outputs.log_probs, outputs.label_mask.to(outputs.log_probs.dtype))
        if model.training and self._divides_by_accumulation:
            loss = loss / self.current_gradient_accumulation_steps
        return (loss, result[1]) if return_outputs else loss
