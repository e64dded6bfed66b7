"""Transformers backend: batched sampling over a `PreTrainedModel`, with exact structured attention.

This class re-encodes every request from scratch (one blocking `continue_batch` per round): the
reference that `ForkingTransformersBackend` (hf_forking.py, the default of `transformers_engine`:
KV forking and continuous batching) is tested against, and the backend for `kv_forking=False`.

Used where vLLM is absent, inside GRPO on CPU (it decodes with the live policy, no weight
copy), and as the exact Unseen engine: each request's prefill runs with the path-window mask
and multiverse positions from `parallel_r1.structure` (plain causal for Seen), so a summary
sees all paths with the positions the model was trained with.

Decoding after the prefill needs no structure: the loop forks each path as its own request,
so a new token may attend to every real token in its row's cache (the context, and its own
path or summary) and its position is the row's last position + 1. Finished rows are dropped
from the KV cache as they stop, and each request samples with its own seeded generator, so
a request's tokens do not depend on which others share its batch.
"""

from __future__ import annotations

from typing import Callable, Sequence, cast

import torch

from parallel_r1.engine.attention import use_gqa_sdpa
from parallel_r1.engine.base import SegmentRequest, SegmentResult
from parallel_r1.errors import PipelineError
from parallel_r1.structure import TagIds, attention_inputs, build_structure

LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _unwrap(model):
    """The model under DDP/accelerate-style wrappers (`.module`)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def no_autocast(model):
    """Decode in the weights' own dtype even when called inside a trainer's autocast region.

    A rollout function may be called inside a trainer's bf16 autocast region; autocast would then
    cast every fp32 weight matrix to bf16 on every decode step, and the rollouts would no longer
    be sampled from the fp32 policy that computes their log-probs.
    """
    return torch.autocast(device_type=next(model.parameters()).device.type, enabled=False)


class TransformersBackend:
    """Continue token sequences with a transformers causal LM.

    max_batch_size: requests per forward batch (sorted by length to limit padding).
    logits_processor: optional hook `(input_ids [B, L] left-padded, scores [B, V]) -> scores`,
        applied before bans, temperature and top-p (tests force tags with it).
    """

    def __init__(self, model, tags: TagIds, pad_token_id: int, max_batch_size: int = 16,
                 logits_processor: LogitsProcessor | None = None) -> None:
        if max_batch_size < 1:
            raise PipelineError(f"transformers backend: max_batch_size must be >= 1, got {max_batch_size}")
        self.model = _unwrap(model)
        use_gqa_sdpa(self.model)  # the KV heads are not copied per step on CPU (engine/attention.py)
        self.tags = tags
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.logits_processor = logits_processor

    def continue_batch(self, requests: Sequence[SegmentRequest]) -> list[SegmentResult]:
        results: list[SegmentResult | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: (requests[i].structured,
                                                            len(requests[i].token_ids)))
        chunks: list[list[int]] = []
        for index in order:
            if requests[index].max_new_tokens <= 0:
                results[index] = SegmentResult([], [], False)
            elif (chunks and len(chunks[-1]) < self.max_batch_size
                  and requests[chunks[-1][0]].structured == requests[index].structured):
                chunks[-1].append(index)
            else:
                chunks.append([index])
        was_training = self.model.training
        self.model.eval()  # no dropout, and the KV cache stays on under gradient checkpointing
        try:
            with torch.inference_mode(), no_autocast(self.model):
                for chunk in chunks:
                    for index, result in zip(chunk, self._run([requests[i] for i in chunk]), strict=True):
                        results[index] = result
        finally:
            self.model.train(was_training)
        return cast(list[SegmentResult], results)  # every index was filled: empty requests or a chunk

    def sync_weights(self, model) -> None:
        """Nothing to copy when generating with the trained model object itself (the GRPO case)."""
        model = _unwrap(model)
        if model is not self.model:
            self.model.load_state_dict(model.state_dict())

    def close(self) -> None:
        self.model = None

    # ------------------------------------------------------------------ one batch

    def _prefill_inputs(self, requests: Sequence[SegmentRequest]) -> dict:
        device = self.model.device
        length = max(len(r.token_ids) for r in requests)
        input_ids = torch.full((len(requests), length), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(requests), length), dtype=torch.long)
        for row, request in enumerate(requests):
            input_ids[row, length - len(request.token_ids):] = torch.tensor(request.token_ids)
            attention[row, length - len(request.token_ids):] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        structured = requests[0].structured
        structure = build_structure(input_ids, attention, self.tags, structured=structured)
        if structured:
            dtype = next(p.dtype for p in self.model.parameters() if p.is_floating_point())
            forward = attention_inputs(structure, self.model.config._attn_implementation, dtype)
        else:
            forward = {"attention_mask": attention, "position_ids": structure.position_ids}
        return {"input_ids": input_ids, "padding": attention, "forward": forward,
                "last_position": structure.position_ids[:, -1]}

    def _run(self, requests: Sequence[SegmentRequest]) -> list[SegmentResult]:
        from transformers import DynamicCache

        device = self.model.device
        prefill = self._prefill_inputs(requests)
        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=prefill["input_ids"], past_key_values=cache, use_cache=True,
                            logits_to_keep=1, **prefill["forward"]).logits[:, -1, :]
        sequences, padding, position = prefill["input_ids"], prefill["padding"], prefill["last_position"]
        generators = [torch.Generator(device=device).manual_seed(r.seed % (2 ** 63)) for r in requests]
        tokens: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[float]] = [[] for _ in requests]
        stopped = [False] * len(requests)
        active = list(range(len(requests)))  # request index of each cache row
        while True:
            rows = [requests[i] for i in active]
            new, new_logprobs = self._sample(logits, sequences, rows, [generators[i] for i in active])
            keep = []
            for row, index in enumerate(active):
                token = int(new[row])
                tokens[index].append(token)
                logprobs[index].append(float(new_logprobs[row]))
                if token in requests[index].stop_ids:
                    stopped[index] = True
                elif len(tokens[index]) < requests[index].max_new_tokens:
                    keep.append(row)
            if not keep:
                break
            if len(keep) < len(active):
                selected = torch.tensor(keep, device=device)
                cache.batch_select_indices(selected)
                new, sequences = new[selected], sequences[selected]
                padding, position = padding[selected], position[selected]
                active = [active[row] for row in keep]
            sequences = torch.cat([sequences, new[:, None]], dim=1)
            padding = torch.cat([padding, torch.ones_like(new[:, None])], dim=1)
            position = position + 1
            logits = self.model(input_ids=new[:, None], attention_mask=padding,
                                position_ids=position[:, None], past_key_values=cache,
                                use_cache=True).logits[:, -1, :]
        return [SegmentResult(t, lp, s) for t, lp, s in zip(tokens, logprobs, stopped, strict=True)]

    def _sample(self, logits: torch.Tensor, sequences: torch.Tensor, requests: Sequence[SegmentRequest],
                generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token per row and the log-prob it was sampled with (vLLM's processed_logprobs)."""
        scores = logits.float()
        if self.logits_processor is not None:
            scores = self.logits_processor(sequences, scores)
        for row, request in enumerate(requests):
            if request.banned_ids:
                scores[row, list(request.banned_ids)] = float("-inf")
        temperature = torch.tensor([r.temperature for r in requests], device=scores.device)
        greedy = temperature <= 0
        scores = scores / torch.where(greedy, 1.0, temperature)[:, None]
        top_p = torch.tensor([1.0 if r.temperature <= 0 else r.top_p for r in requests], device=scores.device)
        if bool((top_p < 1).any()):
            scores = _top_p_filter(scores, top_p)
        log_probs = torch.log_softmax(scores, dim=-1)
        chosen = torch.where(greedy, log_probs.argmax(dim=-1), _inverse_cdf_sample(log_probs, generators))
        return chosen, log_probs.gather(1, chosen[:, None])[:, 0]


def _inverse_cdf_sample(log_probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row from one uniform draw of the row's generator (multinomial is ~50x slower
    over a 152k vocabulary on CPU). u is in (0, 1], so a zero-probability token is never picked."""
    cdf = log_probs.exp().cumsum(dim=-1)
    uniform = torch.stack([1.0 - torch.rand((), generator=g, device=log_probs.device) for g in generators])
    picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None].contiguous())[:, 0]
    return picked.clamp(max=log_probs.shape[-1] - 1)


def _top_p_filter(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask the tokens outside each row's nucleus (the smallest set with mass >= top_p)."""
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    probs = sorted_scores.softmax(dim=-1)
    outside = probs.cumsum(dim=-1) - probs > top_p[:, None]  # the top token is always kept
    return scores.scatter(1, order, sorted_scores.masked_fill(outside, float("-inf")))
