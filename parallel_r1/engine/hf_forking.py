"""KV-forking transformers backend: every segment continues the KV cache of the segments before it.

The engine submits each segment as it becomes due (`submit`) and calls `step` until the results
come back; every step admits the queued segments into the running batch and decodes one token
for all rows (continuous batching: a rollout never waits for another). Per segment:

  1. reuse: walk the request's `kv_spans` and keep every cached column that is provably what
     encoding `token_ids` from scratch (the re-prefill of `TransformersBackend.continue_batch`)
     computes: same token, same position id, and it attended exactly the columns the structure
     of `token_ids` lets it see. The first column that differs ends the reuse. A span's tokens
     its segment never fed (the context's `<Parallel>`, a path's last sampled token and its
     `</Path>`) are encoded first, in that segment's own row, when anything follows the span:
     so the N paths of a block share one `<Parallel>` column, and a summary finds every path
     complete.
  2. join: encode the rest of `token_ids` on top of the reused columns with the structure's mask
     (a prompt: all of it; a path: `<Parallel>` and `<Path>`; a summary: `</Parallel>`, the
     newline and `<Summary>`), batched with the other joiners of the step, and sample.
  3. decode: the row decodes in the pool until a stop id or its budget; its KV is then kept
     under `kv_key` until the engine releases it.

Why this is exact for Unseen: a path row holds the context and its own path, computed with
multiverse positions (rotary is applied before caching) and attending to exactly what the
path-window mask allows. A summary assembled from the context's columns and each path's own
columns therefore holds, column for column, what a structured forward over the whole sequence
computes, and its tokens attend to all of them: the training structure, without re-prefill.

Seen (causal), what "exact" means: paths are sampled independently (each sees the context only,
as the official rollout forks them), and so are their log-probs; the summary and all later text
are conditioned on the causal concatenation of the paths, as the trainer scores them. The check
in step 1 enforces it: the first path's columns are reused, later paths (which causally see the
paths before them) are re-encoded once, their tokens only.

Needs a model whose layers all keep a full KV cache (Llama, Qwen3, ...: any HF causal LM with
rotary positions taking `position_ids`); sliding-window models use `TransformersBackend`.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Hashable, Literal, Sequence

import torch

from parallel_r1.engine.base import SegmentRequest, SegmentResult
from parallel_r1.engine.hf import TransformersBackend, no_autocast
from parallel_r1.engine.kv_pool import Batch, DecodePool, KeptRow, PoolRow, cache_over, full_attention_only
from parallel_r1.engine.lockstep import Lockstep
from parallel_r1.errors import PipelineError
from parallel_r1.structure import Structure, attention_inputs, build_structure

Scheduling = Literal["continuous", "rounds"]
MIN_SHARED_PREFIX = 16  # leading tokens rows must share before one encoding serves them all


@dataclass
class ForkingStats:
    """Where the backend's encoded columns came from (tests and benchmarks read it).

    encoded: tokens no cached column could stand for, encoded in a prefill (prompts, the tags
    the engine inserts, a path's closing tag, a Seen summary's later paths); reused: cached
    columns segments took over instead; decoded: one-token decode steps. (Batching a join with
    one that encodes more tokens re-encodes a few reused columns too; neither count has those.)
    """

    encoded: int = 0
    reused: int = 0
    decoded: int = 0


@dataclass
class _Encode:
    """One row to encode: `reused` columns (the first of `token_ids`), then the other tokens."""

    token_ids: list[int]
    reused: KeptRow | None
    positions: torch.Tensor  # Long[L] for all of token_ids
    hidden_start: torch.Tensor  # Long[L]: the structure's hidden window of each token
    hidden_end: torch.Tensor

    @property
    def new(self) -> int:
        return len(self.token_ids) - (len(self.reused) if self.reused is not None else 0)


class ForkingTransformersBackend(TransformersBackend):
    """`TransformersBackend` plus the streaming calls (`submit`/`step`/`release`) with KV forking.

    max_batch_size: rows decoded together (queued segments wait for a free row).
    scheduling: "continuous" admits segments every step; "rounds" only when the batch is empty
        (a round barrier, kept to measure what continuous batching buys).
    `continue_batch` (inherited) still re-encodes every request from scratch.
    """

    def __init__(self, model, tags, pad_token_id: int, max_batch_size: int = 16, logits_processor=None,
                 scheduling: Scheduling = "continuous") -> None:
        super().__init__(model, tags, pad_token_id, max_batch_size, logits_processor)
        if scheduling not in ("continuous", "rounds"):
            raise PipelineError(f"transformers backend: scheduling must be 'continuous' or 'rounds', "
                                f"got {scheduling!r}")
        if not full_attention_only(self.model.config):
            raise PipelineError(f"transformers backend: {type(self.model).__name__} has sliding-window or "
                                "non-attention layers; KV forking needs full caches (use kv_forking=False)")
        self.scheduling = scheduling
        self._kept: dict[Hashable, KeptRow] = {}
        self._queue: deque[tuple[int, SegmentRequest]] = deque()
        self._done: list[tuple[int, SegmentResult]] = []
        # FSDP across processes: every forward paired with the other processes' (engine/lockstep.py)
        self._lockstep = Lockstep(self.model, pad_token_id) if Lockstep.needed(self.model) else None
        self._forward = self._lockstep.forward if self._lockstep is not None else self.model
        self._pool = DecodePool(self.model, pad_token_id, forward=self._forward)
        self._tickets = itertools.count()
        self._next_id = 0  # column identities
        self._prefix: KeptRow | None = None  # the shared prompt prefix of this `generate` call
        self.share_prompts = True  # prompts encode their common prefix once (benchmarks turn it off)
        self.stats = ForkingStats()

    # ------------------------------------------------------------------ streaming calls

    def submit(self, request: SegmentRequest) -> int:
        ticket = next(self._tickets)
        if request.max_new_tokens <= 0:
            self._done.append((ticket, SegmentResult([], [], False)))
        else:
            self._queue.append((ticket, request))
        return ticket

    def release(self, keys: Sequence[Hashable]) -> None:
        for key in keys:
            self._kept.pop(key, None)

    def step(self) -> list[tuple[int, SegmentResult]]:
        finished, self._done = self._done, []
        with self._generating():
            logits = []
            if len(self._pool):
                logits.append(self._pool.decode(self._fresh_ids(len(self._pool))))
                self.stats.decoded += len(self._pool)
            logits.extend(self._admit())
            if logits:
                finished.extend(self._sample_and_retire(torch.cat(logits)))
        return finished

    def drain(self) -> None:
        """End of a `generate` call: forget its shared prompt prefix (a live policy's weights change
        before the next call) and, under FSDP, pair the forwards other processes still run."""
        self._prefix = None
        if self._lockstep is not None:
            with self._generating():
                self._lockstep.drain()

    def sync_weights(self, model) -> None:
        super().sync_weights(model)
        self._kept.clear()  # computed with the old weights
        self._prefix = None

    def close(self) -> None:
        self._kept.clear()
        self._prefix = None
        self._queue.clear()
        self._pool.keep([])  # drop every row and its KV
        super().close()

    # ------------------------------------------------------------------ one step

    @contextlib.contextmanager
    def _generating(self):
        was_training = self.model.training
        self.model.eval()  # no dropout, and the KV cache stays on under gradient checkpointing
        try:
            with torch.inference_mode(), no_autocast(self.model):
                yield
        finally:
            self.model.train(was_training)

    def _admit(self) -> list[torch.Tensor]:
        """Join the queued segments that fit; the logits of their last tokens, in pool order."""
        if self.scheduling == "rounds" and len(self._pool):
            return []
        room = min(self.max_batch_size - len(self._pool), len(self._queue))
        joining = [self._queue.popleft() for _ in range(room)]
        if not joining:
            return []
        structures = [self._structure(request) for _, request in joining]
        tails: dict[Hashable, tuple[KeptRow, _Encode]] = {}
        for (_, request), structure in zip(joining, structures, strict=True):
            for key, tail in self._reuse(request, structure, tails_wanted=True)[1].items():
                tails.setdefault(key, tail)
        for group in self._groups([tail for _, tail in tails.values()]):
            batch, _ = self._encode(group)
            for index, item in enumerate(group):
                encoded = batch.row(index)
                row = next(row for row, tail in tails.values() if tail is item)
                row.extend(encoded.slice(len(encoded) - item.new, len(encoded)))
        items = []
        for (ticket, request), structure in zip(joining, structures, strict=True):
            reused = self._assemble(self._reuse(request, structure, tails_wanted=False)[0])
            if reused is not None and len(reused) == len(request.token_ids):  # keep one token to encode
                reused = reused.slice(0, len(reused) - 1)
            items.append((ticket, request, _Encode(list(request.token_ids), reused, *structure)))
        self._share_prompt_prefix([item for _, _, item in items])
        logits = []
        for group in self._groups(items, key=lambda entry: entry[2]):
            batch, last_logits = self._encode([item for _, _, item in group])
            rows = [PoolRow(ticket, request, self._generator(request), int(item.positions[-1]) + 1)
                    for ticket, request, item in group]
            self._pool.add(batch, rows)
            logits.append(last_logits)
        return logits

    def _sample_and_retire(self, logits: torch.Tensor) -> list[tuple[int, SegmentResult]]:
        rows, batch = self._pool.rows, self._pool.batch
        assert batch is not None  # the rows were just decoded
        new, new_logprobs = self._sample(logits, batch.token_ids, [row.request for row in rows],
                                         [row.generator for row in rows])
        finished, keep = [], []
        for index, row in enumerate(rows):
            token = int(new[index])
            row.tokens.append(token)
            row.logprobs.append(float(new_logprobs[index]))
            stopped = token in row.request.stop_ids
            if stopped or len(row.tokens) >= row.request.max_new_tokens:
                if row.request.kv_key is not None:
                    self._kept[row.request.kv_key] = batch.row(index)
                finished.append((row.ticket, SegmentResult(row.tokens, row.logprobs, stopped)))
            else:
                row.pending = token
                keep.append(index)
        self._pool.keep(keep)
        return finished

    # ------------------------------------------------------------------ reuse

    def _structure(self, request: SegmentRequest) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Position ids and hidden windows of `token_ids`: what a re-prefill would encode it with."""
        ids = torch.tensor([request.token_ids], device=self.model.device)
        structure = build_structure(ids, None, self.tags, structured=request.structured)
        return structure.position_ids[0], structure.hidden_start[0], structure.hidden_end[0]

    def _reuse(self, request: SegmentRequest, structure, tails_wanted: bool):
        """The kept columns `request` may reuse, as (row, start, count) pieces in token order; with
        `tails_wanted`, also the tokens to encode first in a span's own row ({key: (row, _Encode)})."""
        positions, hidden_start, hidden_end = structure
        device = positions.device
        tokens = torch.tensor(request.token_ids, device=device)
        pieces: list[tuple[KeptRow, int, int, int]] = []
        tails: dict[Hashable, tuple[KeptRow, _Encode]] = {}
        reused_ids: list[torch.Tensor] = []
        at = 0
        for span in request.kv_spans:
            row = self._kept.get(span.key)
            if row is None or span.start > min(at, len(row)) or at + span.length > len(tokens):
                break
            if span.start and not torch.equal(row.ids[:span.start], torch.cat(reused_ids)[:span.start]):
                break  # the span's segment was not computed on top of the columns reused so far
            window = (span.start, at) if span.start < at else None  # hidden: the sibling paths in between
            have = min(span.length, len(row) - span.start)
            own = slice(span.start, span.start + have)
            if window is None:  # in place: each column must hide what it hid in its row
                expected = (row.hidden_start[own], row.hidden_end[own])
            else:  # moved after sibling paths: it hid nothing in its row, and hides them here
                expected = (torch.full_like(row.hidden_start[own], window[0]),
                            torch.full_like(row.hidden_end[own], window[1]))
            ok = ((row.positions[own] == positions[at:at + have])
                  & (torch.tensor(row.tokens[own], device=device) == tokens[at:at + have])
                  & _same_windows(hidden_start[at:at + have], hidden_end[at:at + have], *expected))
            if window is not None:
                ok &= row.hidden_end[own] <= row.hidden_start[own]
            good = _leading(ok)
            pieces.append((row, span.start, good, at))
            reused_ids.append(row.ids[span.start:span.start + good])
            at_end = at + span.length == len(tokens)
            if good < have or (have < span.length and (at_end or not tails_wanted)):
                break  # missing tokens at the very end are simply encoded by the join
            if have < span.length:
                lo, hi = at + have, at + span.length
                none = torch.zeros(hi - lo, dtype=torch.long, device=device)
                expected = (none + window[0], none + window[1]) if window else (none, none)
                if _leading(_same_windows(hidden_start[lo:hi], hidden_end[lo:hi], *expected)) < hi - lo:
                    break
                no_window = torch.zeros(hi - lo, dtype=torch.long, device=device)  # it attends its whole row
                tails[span.key] = (row, _Encode(row.tokens + list(request.token_ids[lo:hi]), row,
                                                torch.cat([row.positions, positions[lo:hi]]),
                                                torch.cat([row.hidden_start, no_window]),
                                                torch.cat([row.hidden_end, no_window])))
                reused_ids.append(torch.full((hi - lo,), -2, device=device))  # encoded before the join
            at += span.length
        return pieces, tails

    def _assemble(self, pieces: list[tuple[KeptRow, int, int, int]]) -> KeptRow | None:
        """The pieces' columns side by side, in token order, with their windows where they now sit."""
        cut = []
        for row, start, count, at in pieces:
            if count > 0:
                piece = row.slice(start, start + count)
                if start < at:  # a path moved after its siblings: it hides them
                    piece.hidden_start = torch.full_like(piece.hidden_start, start)
                    piece.hidden_end = torch.full_like(piece.hidden_end, at)
                cut.append(piece)
        if not cut:
            return None
        if len(cut) == 1:
            return cut[0]
        return KeptRow([t for piece in cut for t in piece.tokens], torch.cat([p.positions for p in cut]),
                       torch.cat([p.ids for p in cut]),
                       [torch.cat(layer, dim=1) for layer in zip(*(p.keys for p in cut), strict=True)],
                       [torch.cat(layer, dim=1) for layer in zip(*(p.values for p in cut), strict=True)],
                       torch.cat([p.hidden_start for p in cut]), torch.cat([p.hidden_end for p in cut]))

    def _share_prompt_prefix(self, items: list[_Encode]) -> None:
        """Rows that reuse nothing and open with the same tokens take those columns from one encoding:
        the prompt template once per `generate` call, and a GRPO group's repeated prompt once per group.

        Exact as every reuse here: a column is shared only where the tokens, positions and hidden
        windows up to it agree, so it is what each row's own prefill computes. The template prefix
        serves the rest of the call (prompts admitted later, as rows free up) and is dropped at its
        end (`drain`): a live policy's weights change between calls.
        """
        fresh = [item for item in items if item.reused is None] if self.share_prompts else []
        if len(fresh) > 1:
            length = min(_shared_length(fresh[0], other) for other in fresh[1:])
            have = _shared_length(fresh[0], self._prefix) if self._prefix is not None else 0
            if length >= MIN_SHARED_PREFIX and length > have:
                base = self._prefix.slice(0, have) if self._prefix is not None and have else None
                self._prefix = self._encode([_head(fresh[0], length, base)])[0].row(0)
        if self._prefix is not None:
            for item in fresh:
                shared = _shared_length(item, self._prefix)
                if shared >= MIN_SHARED_PREFIX:
                    item.reused = self._prefix.slice(0, shared)
        copies: dict[tuple[int, ...], list[_Encode]] = {}
        for item in fresh:
            copies.setdefault(tuple(item.token_ids), []).append(item)
        heads: list[tuple[_Encode, list[_Encode]]] = []  # a repeated prompt but its last token, and its rows
        for group in copies.values():
            head = _head(group[0], len(group[0].token_ids) - 1, group[0].reused)
            if len(group) > 1 and head.new > 0:
                heads.append((head, group))
        rows_of = {id(head): group for head, group in heads}
        for batch_of_heads in self._groups([head for head, _ in heads]):
            batch, _ = self._encode(batch_of_heads)
            for index, head in enumerate(batch_of_heads):
                for item in rows_of[id(head)]:
                    item.reused = batch.row(index)

    # ------------------------------------------------------------------ encoding

    def _groups(self, entries: list, key=lambda entry: entry) -> list[list]:
        """Entries batched together: similar numbers of new tokens, at most max_batch_size each."""
        entries = sorted(entries, key=lambda entry: key(entry).new)
        groups: list[list] = []
        for entry in entries:
            if (groups and len(groups[-1]) < self.max_batch_size
                    and key(entry).new <= 2 * key(groups[-1][0]).new + 8):
                groups[-1].append(entry)
            else:
                groups.append([entry])
        return groups

    def _encode(self, items: list[_Encode]) -> tuple[Batch, torch.Tensor]:
        """Encode each item's new tokens on top of its reused columns, as one left-padded batch.

        Every row feeds its last Q tokens (Q: the most new tokens of any item), so an item with
        fewer re-encodes a few of its reused columns (exactly: same structure); columns before
        those come from the reused KV. Returns all rows' columns and their last token's logits.
        """
        device = self.model.device
        width = max(len(item.token_ids) for item in items)
        fed = max(item.new for item in items)
        cached = width - fed
        token_ids = torch.full((len(items), width), self.pad_token_id, dtype=torch.long, device=device)
        valid = torch.zeros((len(items), width), dtype=torch.bool, device=device)
        positions, hidden_start, hidden_end, own_start, own_end = (torch.zeros_like(token_ids)
                                                                   for _ in range(5))
        ids = torch.full_like(token_ids, -1)
        keys, values = [], []
        for row, item in enumerate(items):
            offset = width - len(item.token_ids)
            token_ids[row, offset:] = torch.tensor(item.token_ids, device=device)
            valid[row, offset:] = True
            positions[row, offset:] = item.positions
            windowed = item.hidden_end > item.hidden_start
            hidden_start[row, offset:] = torch.where(windowed, item.hidden_start + offset, 0)
            hidden_end[row, offset:] = torch.where(windowed, item.hidden_end + offset, 0)
            own_start[row, offset:] = torch.where(windowed, item.hidden_start, 0)
            own_end[row, offset:] = torch.where(windowed, item.hidden_end, 0)
            ids[row, offset:] = self._fresh_ids(len(item.token_ids))
            if item.reused is not None:  # re-encoded reused columns are the same computation: same ids
                ids[row, offset:offset + len(item.reused)] = item.reused.ids
        if cached:
            sample = next(item.reused for item in items if item.reused is not None)
            layers = len(sample.keys)
            for layer in range(layers):
                shape = (len(items), *sample.keys[layer].shape[:1], cached, sample.keys[layer].shape[-1])
                keys.append(torch.zeros(shape, dtype=sample.keys[layer].dtype, device=device))
                values.append(torch.zeros(shape, dtype=sample.values[layer].dtype, device=device))
            for row, item in enumerate(items):
                offset = width - len(item.token_ids)
                if offset < cached:
                    reused = item.reused
                    assert reused is not None  # a row starting inside the cached columns reuses them
                    for layer in range(layers):
                        keys[layer][row, :, offset:cached] = reused.keys[layer][:, :cached - offset]
                        values[layer][row, :, offset:cached] = reused.values[layer][:, :cached - offset]
        cache = cache_over(self.model.config, keys, values)
        self.stats.encoded += sum(item.new for item in items)
        self.stats.reused += sum(len(item.reused) for item in items if item.reused is not None)
        structure = Structure(position_ids=positions, broken_blocks=0, open_blocks=0, valid=valid,
                              hidden_start=hidden_start, hidden_end=hidden_end)
        if bool((hidden_end[:, cached:] > hidden_start[:, cached:]).any()):
            dtype = next(p.dtype for p in self.model.parameters() if p.is_floating_point())
            forward = attention_inputs(structure, self.model.config._attn_implementation, dtype,
                                       query_length=fed)
        else:
            forward = {"attention_mask": valid.long(), "position_ids": positions[:, cached:]}
        logits = self._forward(input_ids=token_ids[:, cached:], past_key_values=cache, use_cache=True,
                               logits_to_keep=1, **forward).logits[:, -1, :]
        padding = ~valid[:, None, :, None]
        batch = Batch([layer.keys.masked_fill(padding, 0) for layer in cache.layers],
                      [layer.values.masked_fill(padding, 0) for layer in cache.layers],
                      valid, token_ids, positions, ids, own_start, own_end)
        return batch, logits

    def _generator(self, request: SegmentRequest) -> torch.Generator:
        return torch.Generator(device=self.model.device).manual_seed(request.seed % 2 ** 63)

    def _fresh_ids(self, count: int) -> torch.Tensor:
        start, self._next_id = self._next_id, self._next_id + count
        return torch.arange(start, start + count, device=self.model.device)


def _head(item: _Encode, length: int, reused: KeptRow | None = None) -> _Encode:
    """`item`'s first `length` tokens as a row of their own, on top of `reused` columns."""
    if reused is not None and len(reused) > length:
        reused = reused.slice(0, length)
    return _Encode(item.token_ids[:length], reused, item.positions[:length], item.hidden_start[:length],
                   item.hidden_end[:length])


def _shared_length(item: _Encode, other: _Encode | KeptRow) -> int:
    """Leading columns `item` can take from `other` (same tokens, positions and hidden windows), leaving
    `item` at least one token to encode: its last token's logits start its decoding."""
    others = other.token_ids if isinstance(other, _Encode) else other.tokens
    count = min(len(item.token_ids) - 1, len(others))
    if count <= 0:
        return 0
    device = item.positions.device
    ok = ((torch.tensor(item.token_ids[:count], device=device) == torch.tensor(others[:count], device=device))
          & (item.positions[:count] == other.positions[:count])
          & _same_windows(item.hidden_start[:count], item.hidden_end[:count], other.hidden_start[:count],
                          other.hidden_end[:count]))
    return _leading(ok)


def _leading(ok: torch.Tensor) -> int:
    """How many leading entries of a bool vector are True."""
    return int(ok.long().cumprod(0).sum()) if ok.numel() else 0


def _same_windows(start: torch.Tensor, end: torch.Tensor, other_start: torch.Tensor,
                  other_end: torch.Tensor) -> torch.Tensor:
    """Per column: do two hidden windows hide the same columns (any two empty ones do)?"""
    empty, other_empty = end <= start, other_end <= other_start
    return (empty & other_empty) | (~empty & (start == other_start) & (end == other_end))
