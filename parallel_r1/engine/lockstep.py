"""Forwards of a sharded policy, paired across data-parallel processes.

Under FSDP (1 or 2) every forward of the policy all-gathers each layer's shards: a collective
that every process must enter, in the same order. The transformers engine admits and retires
rollouts every decode step, so processes with different prompts run different numbers of
forwards, and the one that finishes first would leave the others waiting in an all-gather
forever. HF `generate` solves this with `synced_gpus` (a process that is done keeps running dummy
forwards until every process is). `Lockstep` does the same for the engine: before each real
forward every process votes 1 (`all_reduce` MAX), and at the end of a `generate` call a process
votes 0 and runs a one-token dummy forward while any other still votes 1. The i-th forward of
every process is then paired, whatever its inputs; tokens and log-probs are those of the whole
model (FSDP computes with the gathered parameters), which is what makes exact Unseen decoding
possible on the paper's FSDP2 path.

Outside a multi-process FSDP run `Lockstep.needed` is False and the engine calls the model directly.
"""

from __future__ import annotations

import torch


class Lockstep:
    """Votes around a sharded model's forwards so every process runs the same number of them."""

    def __init__(self, model, pad_token_id: int) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.dummy_forwards = 0  # forwards run only to pair another process's (tests read it)

    @staticmethod
    def needed(model) -> bool:
        """True when `model` is FSDP-managed in a process group of more than one process."""
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return False
        if torch.distributed.get_world_size() < 2:
            return False
        from transformers.distributed.fsdp import is_fsdp_managed_module

        return is_fsdp_managed_module(model)

    def forward(self, **inputs):
        """One real forward, paired with one forward of every other process."""
        self._vote(1)
        return self.model(**inputs)

    def drain(self) -> None:
        """This process is done: pair the forwards the others still run with dummy ones."""
        while self._vote(0):
            device = next(self.model.parameters()).device
            self.model(input_ids=torch.full((1, 1), self.pad_token_id, device=device), use_cache=False,
                       logits_to_keep=1)
            self.dummy_forwards += 1

    def _vote(self, running: int) -> bool:
        """Whether any process votes 1 (on the model's device: NCCL reduces CUDA tensors only)."""
        vote = torch.tensor([running], device=next(self.model.parameters()).device)
        torch.distributed.all_reduce(vote, op=torch.distributed.ReduceOp.MAX)
        return bool(vote.item())
