"""KV kept between segments, and the running decode batch of the KV-forking transformers backend.

A `KeptRow` is the KV cache of one finished segment's sequence (every token it fed to the model:
its request tokens and the tokens it generated but the last), compact, with each column's token,
position, hidden window and identity. Column i attended to columns [0, i] of its row except its
hidden window [hidden_start, hidden_end) (empty when end <= start: outside paths, first paths).
Identities (`ids`) say which columns are the *same computation*: a path forked from the context
shares the context's ids, so a later summary can check that a path's columns were computed on
top of exactly the context it reuses.

The `DecodePool` is the batch every decode step runs: one `DynamicCache` [B, H, T, D] whose rows
are left padded (each row's columns are contiguous at the right), with a [B, T] validity mask
passed to the model as its 2D attention mask. Rows join (padded to the pool's width or the pool
to theirs) and leave (batch rows dropped, all-padding leading columns trimmed) between steps —
continuous batching without paged memory. A decode step needs no structured mask: every row
attends to all of its own real columns (a path row holds only the context and its own path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from parallel_r1.engine.base import SegmentRequest


@dataclass
class KeptRow:
    """KV of one segment's sequence: per layer [H, T, D] keys and values, T tokens, no padding."""

    tokens: list[int]
    positions: torch.Tensor  # Long[T], the position ids the columns were computed with
    ids: torch.Tensor  # Long[T], column identities
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    hidden_start: torch.Tensor  # Long[T], in row coordinates
    hidden_end: torch.Tensor

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, other: KeptRow) -> None:
        """Append `other`'s columns (computed in this row's context, e.g. a path's closing tag)."""
        self.tokens = self.tokens + other.tokens
        self.positions = torch.cat([self.positions, other.positions])
        self.ids = torch.cat([self.ids, other.ids])
        self.keys = [torch.cat([a, b], dim=1) for a, b in zip(self.keys, other.keys, strict=True)]
        self.values = [torch.cat([a, b], dim=1) for a, b in zip(self.values, other.values, strict=True)]
        self.hidden_start = torch.cat([self.hidden_start, other.hidden_start])
        self.hidden_end = torch.cat([self.hidden_end, other.hidden_end])

    def slice(self, start: int, stop: int) -> KeptRow:
        """Columns [start, stop) (their windows still in this row's coordinates)."""
        return KeptRow(self.tokens[start:stop], self.positions[start:stop], self.ids[start:stop],
                       [k[:, start:stop] for k in self.keys], [v[:, start:stop] for v in self.values],
                       self.hidden_start[start:stop], self.hidden_end[start:stop])


@dataclass
class PoolRow:
    """Bookkeeping of one request decoding in the pool."""

    ticket: int
    request: SegmentRequest
    generator: torch.Generator
    next_position: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    pending: int = -1  # the last sampled token: fed at the next decode step


@dataclass
class Batch:
    """Left-padded columns of some rows: KV per layer [B, H, W, D] and [B, W] per-column data
    (hidden windows counted from each row's first real column, so padding never shifts them)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor  # Bool
    token_ids: torch.Tensor
    positions: torch.Tensor
    ids: torch.Tensor
    hidden_start: torch.Tensor
    hidden_end: torch.Tensor

    @property
    def width(self) -> int:
        return self.valid.shape[1]

    def padded(self, width: int, pad_token_id: int) -> Batch:
        """The same rows with `width - self.width` padding columns added on the left."""
        extra = width - self.width
        if extra == 0:
            return self

        def pad(tensor: torch.Tensor, dim: int, value) -> torch.Tensor:
            shape = list(tensor.shape)
            shape[dim] = extra
            filler = torch.full(shape, value, dtype=tensor.dtype, device=tensor.device)
            return torch.cat([filler, tensor], dim=dim)

        return Batch([pad(k, 2, 0) for k in self.keys], [pad(v, 2, 0) for v in self.values],
                     pad(self.valid, 1, False), pad(self.token_ids, 1, pad_token_id),
                     pad(self.positions, 1, 0), pad(self.ids, 1, -1), pad(self.hidden_start, 1, 0),
                     pad(self.hidden_end, 1, 0))

    def row(self, index: int) -> KeptRow:
        """Row `index`'s real columns, compact."""
        real = self.valid[index]
        return KeptRow(self.token_ids[index][real].tolist(), self.positions[index][real],
                       self.ids[index][real], [k[index][:, real] for k in self.keys],
                       [v[index][:, real] for v in self.values],
                       self.hidden_start[index][real], self.hidden_end[index][real])


_COLUMN_DATA = ("valid", "token_ids", "positions", "ids", "hidden_start", "hidden_end")


class DecodePool:
    """The rows decoded together, in one DynamicCache that rows join and leave every step."""

    def __init__(self, model, pad_token_id: int, forward=None) -> None:
        self.model = model
        self._forward = forward or model  # the backend's forward (lockstep.Lockstep under FSDP)
        self.pad_token_id = pad_token_id
        self.rows: list[PoolRow] = []
        self.cache: Any = None  # transformers DynamicCache over self.batch's keys/values
        self.batch: Batch | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, batch: Batch, rows: list[PoolRow]) -> None:
        """Join `rows`, whose columns are `batch` (padded to the pool's width, or the pool to theirs)."""
        if self.batch is None:
            merged = batch
        else:
            width = max(self.batch.width, batch.width)
            old, new = self.batch.padded(width, self.pad_token_id), batch.padded(width, self.pad_token_id)
            merged = Batch([torch.cat([a, b]) for a, b in zip(old.keys, new.keys, strict=True)],
                           [torch.cat([a, b]) for a, b in zip(old.values, new.values, strict=True)],
                           *(torch.cat([getattr(old, name), getattr(new, name)])
                             for name in _COLUMN_DATA))
        self._set(merged)
        self.rows.extend(rows)

    def keep(self, indices: list[int]) -> None:
        """Drop every row not in `indices`, and the leading columns no remaining row uses."""
        if indices == list(range(len(self.rows))):
            return  # nobody left: no copy
        self.rows = [self.rows[i] for i in indices]
        if not indices:
            self.batch = self.cache = None
            return
        batch = self.batch
        assert batch is not None  # the pool had rows
        index = torch.tensor(indices, device=batch.valid.device)
        valid = batch.valid[index]
        first = int(valid.any(dim=0).long().argmax())
        pick = (lambda t: t[index, :, first:]) if first else (lambda t: t[index])
        cols = (lambda t: t[index, first:]) if first else (lambda t: t[index])
        self._set(Batch([pick(k) for k in batch.keys], [pick(v) for v in batch.values],
                        *(cols(getattr(batch, name)) for name in _COLUMN_DATA)))

    def decode(self, new_ids: torch.Tensor) -> torch.Tensor:
        """Feed every row's pending token (ids `new_ids` for the new columns); the next logits [B, V]."""
        batch = self.batch
        assert batch is not None  # decode is called on a pool with rows
        device = batch.valid.device
        pending = torch.tensor([row.pending for row in self.rows], device=device)
        position = torch.tensor([row.next_position for row in self.rows], device=device)
        valid = torch.cat([batch.valid, torch.ones_like(batch.valid[:, :1])], dim=1)
        logits = self._forward(input_ids=pending[:, None], attention_mask=valid.long(),
                               position_ids=position[:, None], past_key_values=self.cache,
                               use_cache=True).logits[:, -1, :]
        layers = self.cache.layers
        self.batch = Batch([layer.keys for layer in layers], [layer.values for layer in layers], valid,
                           torch.cat([batch.token_ids, pending[:, None]], dim=1),
                           torch.cat([batch.positions, position[:, None]], dim=1),
                           torch.cat([batch.ids, new_ids[:, None].to(device)], dim=1),
                           *(torch.cat([window, torch.zeros_like(window[:, :1])], dim=1)
                             for window in (batch.hidden_start, batch.hidden_end)))
        for row in self.rows:
            row.next_position += 1
        return logits

    def _set(self, batch: Batch) -> None:
        self.batch = batch
        self.cache = cache_over(self.model.config, batch.keys, batch.values, self.cache)


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer that appends into spare columns instead of concatenating.

    Why: `DynamicLayer.update` copies the whole [B, H, T, D] cache on every decode step; for a
    135M model decoding 16 rows of ~400 tokens on a CPU that copy was a third of the step. Here
    keys/values are views of a buffer with `SPARE` free columns, refilled (one copy) only when
    it is full or when the pool has put other tensors in place (rows joined or left).
    """

    SPARE = 64
    keys: torch.Tensor | None  # DynamicLayer's, declared for mypy (which does not follow transformers)
    values: torch.Tensor | None

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._view: torch.Tensor | None = None  # the keys view last handed out (else: replaced)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.get_seq_length(), key_states.shape[-2]
        buffers = self._buffers
        if buffers is None or self.keys is not self._view or buffers[0].shape[-2] < length + new:
            shape = (*key_states.shape[:2], length + new + self.SPARE, key_states.shape[-1])
            buffers = (key_states.new_empty(shape), value_states.new_empty(shape))
            if length and self.keys is not None and self.values is not None:
                buffers[0][:, :, :length] = self.keys
                buffers[1][:, :, :length] = self.values
            self._buffers = buffers
        buffers[0][:, :, length:length + new] = key_states
        buffers[1][:, :, length:length + new] = value_states
        self.keys, self.values = buffers[0][:, :, :length + new], buffers[1][:, :, :length + new]
        self._view = self.keys
        return self.keys, self.values


def cache_over(config, keys: list[torch.Tensor], values: list[torch.Tensor], cache=None):
    """A DynamicCache (new, or `cache` reused) whose layers hold `keys`/`values` as they are, no copy.

    Sets the layers' tensors directly: DynamicCache has no public call to load tensors without
    copying them (its constructor `update`s each layer, a concatenation). A new cache's layers
    are `GrowingLayer`s (callers check `full_attention_only` first).
    """
    from transformers import DynamicCache

    if cache is None:
        cache = DynamicCache(config=config)
        cache.layers = [GrowingLayer() for _ in cache.layers]
    # `cache.layers` can outnumber `keys` (the engine tests hit it): only the given layers are set
    for layer, layer_keys, layer_values in zip(cache.layers, keys, values, strict=False):
        if not layer.is_initialized:
            layer.lazy_initialization(layer_keys, layer_values)
        layer.keys, layer.values = layer_keys, layer_values
    return cache


def full_attention_only(config) -> bool:
    """Whether every layer of the model keeps a full cache (no sliding window, no linear attention)."""
    from transformers import DynamicCache

    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)
