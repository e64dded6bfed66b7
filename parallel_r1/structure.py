"""Structured attention for the "Unseen" variant: path-window mask and multiverse position ids.

Inside `<Parallel><Path>a</Path><Path>b</Path></Parallel><Summary>s</Summary>` a token of path
`b` may attend to the shared context before the block and to its own path, never to path `a`;
`</Parallel>`, the summary and everything later attend to all earlier tokens. Positions: every
path restarts at pos(`<Parallel>`) + 1 (as the official code does), `</Parallel>` gets
pos(`<Parallel>`) + longest path + 1 (path length in tokens, `<Path>`/`</Path>` included), later
tokens continue from there. Tokens before the first block keep ordinary positions,
cumsum(attention_mask) - 1 as in HF/TRL; padding tokens get position 0.

How the tokens of a block are split, so that no token leaks one path into another: the "head"
(`<Parallel>` and anything before the first `<Path>`) is shared context; a path's region runs from
its `<Path>` up to the next `<Path>` or `</Parallel>`, so a newline between `</Path>` and `<Path>`
belongs to the path before it. Every path region restarts right after the head.

Bad input never raises: a block with misplaced tags (a `</Path>` without opener, `</Parallel>`
inside a path, a nested `<Parallel>`, summary tags inside a block, path tags outside a block)
falls back to causal attention and ordinary positions and is counted in `broken_blocks`; parsing
resumes at the next `</Parallel>` or `<Parallel>`. A block still open when the sequence ends (a
response truncated inside a path, or a path being generated) is a valid prefix, not bad input: by
default (`open_block="structured"`) its paths stay independent and it is counted in
`open_blocks`. Why: the rollout engine generates those paths independently, so recomputing their
log-probs with causal attention would score tokens under a context they were not sampled from,
and cached decoding needs the structure of the open block to never change once written.
`open_block="causal"` treats it as broken instead (counted in `broken_blocks`).

Passing the result to a transformers (5.17-5.19) Qwen3 model, read from masking_utils.py,
modeling_qwen3.py, sdpa_attention.py and integrations/flex_attention.py:
- Any 4D Tensor or `BlockMask` given as `attention_mask` is returned as-is by
  `_preprocess_mask_arguments` (no causal/padding mask is added); `position_ids` go to RoPE.
- "sdpa": a bool [B,1,Lq,Lkv] mask, True = attend, goes straight to
  `F.scaled_dot_product_attention(attn_mask=...)` with is_causal=False (and K/V repeated for GQA:
  no flash kernel with a dense mask, O(L^2) memory).
- "eager": the mask is *added* to the scores, so it must be float (0 = attend, finfo(dtype).min =
  masked); a bool mask would be added as 0/1 and silently ignored.
- "flex_attention": a `BlockMask` is used as `block_mask` (a Tensor would be added as a dense
  score bias); it is built from per-token ids, never from an L x L tensor.
- "flash_attention_*" only accept a 2D padding mask and cannot express path windows: refused.
`attention_inputs` returns the right form; `structured_forward` applies it to every forward call.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterator, Literal

import torch

from parallel_r1.errors import PipelineError
from parallel_r1.format import TAGS

OpenBlock = Literal["structured", "causal"]
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention")


@dataclass(frozen=True)
class TagIds:
    """Token ids of the six parallel tags (added to the tokenizer as special tokens)."""

    parallel_open: int
    parallel_close: int
    path_open: int
    path_close: int
    summary_open: int
    summary_close: int

    @classmethod
    def from_tokenizer(cls, tokenizer) -> TagIds:
        """Read the ids from a tokenizer; each tag must encode to exactly one token."""
        ids = []
        for tag in TAGS:
            encoded = tokenizer.encode(tag, add_special_tokens=False)
            if len(encoded) != 1:
                raise PipelineError(
                    f"tokenizer {getattr(tokenizer, 'name_or_path', '?')}: tag {tag} encodes to "
                    f"{len(encoded)} tokens, expected 1 (add the six tags as special tokens)"
                )
            ids.append(int(encoded[0]))
        if len(set(ids)) != len(ids):
            raise PipelineError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')}: tag ids {ids} are not "
                                "distinct")
        return cls(*ids)

    def as_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor([self.parallel_open, self.parallel_close, self.path_open,
                             self.path_close, self.summary_open, self.summary_close], device=device)


@dataclass(frozen=True, eq=False)
class Structure:
    """Attention structure of a batch, held as per-token tensors (O(L)); masks are built on demand.

    A query token q may attend to key k when k <= q, both are real (non-pad) tokens and k is not in
    [hidden_start[q], hidden_end[q]) -- the earlier sibling paths of q's path (empty for tokens
    outside paths). A padding query attends only to itself, so softmax never sees an empty row.
    """

    position_ids: torch.Tensor  # Long[B, L]
    broken_blocks: int
    open_blocks: int
    valid: torch.Tensor  # Bool[B, L], False = padding
    hidden_start: torch.Tensor  # Long[B, L]
    hidden_end: torch.Tensor  # Long[B, L]

    def may_attend(self, b: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The mask predicate on (broadcastable) batch, query and key indices; also the flex mask_mod."""
        real = self.valid[b, q] & self.valid[b, k]
        hidden = (k >= self.hidden_start[b, q]) & (k < self.hidden_end[b, q])
        return ((k <= q) & real & ~hidden) | (q == k)

    def dense_mask(self, query_length: int | None = None) -> torch.Tensor:
        """Bool[B, 1, Lq, L] mask (True = attend) for the last `query_length` query rows."""
        batch, length = self.valid.shape
        device = self.valid.device
        first = length - (query_length or length)
        b = torch.arange(batch, device=device)[:, None, None, None]
        q = torch.arange(first, length, device=device)[None, None, :, None]
        k = torch.arange(length, device=device)[None, None, None, :]
        return self.may_attend(b, q, k)

    @cached_property
    def mask(self) -> torch.Tensor:
        """Bool[B, 1, L, L] mask, True = may attend (built on first access)."""
        return self.dense_mask()

    def block_mask(self, query_length: int | None = None, block_size: int = 128):
        """FlexAttention `BlockMask` of the same predicate (compiled on CUDA, eager elsewhere)."""
        from torch.nn.attention.flex_attention import create_block_mask

        batch, length = self.valid.shape
        q_len = query_length or length
        offset = length - q_len

        def mask_mod(b, h, q, k):
            return self.may_attend(b, q + offset, k)

        return create_block_mask(mask_mod, B=batch, H=None, Q_LEN=q_len, KV_LEN=length,
                                 device=self.valid.device, BLOCK_SIZE=block_size,
                                 _compile=self.valid.device.type == "cuda")


@dataclass(frozen=True)
class _Block:
    """A block kept structured: the token index of each path's `<Path>`, and where it ends."""

    path_starts: tuple[int, ...]
    end: int  # index of `</Parallel>`, or the sequence length for a block still open
    closed: bool


def _parse_blocks(tag_seq: list[tuple[int, int]], tags: TagIds, length: int,
                  open_block: OpenBlock) -> tuple[list[_Block], int, int]:
    """Walk one sequence's (position, tag id) list; return structured blocks, #broken, #open."""
    blocks: list[_Block] = []
    broken = opened = 0
    state = "top"  # "top" | "block" (inside <Parallel>, between paths) | "path"
    starts: list[int] = []
    skipping = False  # inside a broken region: resume at the next </Parallel> or <Parallel>
    for pos, tag in tag_seq:
        if skipping:
            if tag == tags.parallel_close:
                skipping = False
                continue
            if tag != tags.parallel_open:
                continue
            skipping = False
        if state == "top":
            if tag == tags.parallel_open:
                state, starts = "block", []
            elif tag in (tags.path_open, tags.path_close, tags.parallel_close):
                broken += 1
                skipping = tag != tags.parallel_close
        elif state == "block" and tag == tags.path_open:
            starts.append(pos)
            state = "path"
        elif state == "block" and tag == tags.parallel_close:
            blocks.append(_Block(tuple(starts), pos, closed=True))
            state = "top"
        elif state == "path" and tag == tags.path_close:
            state = "block"
        else:  # any other tag inside a block breaks it
            broken += 1
            state = "top"
            if tag == tags.parallel_open:
                state, starts = "block", []
            elif tag != tags.parallel_close:
                skipping = True
    if state != "top":
        if open_block == "structured":
            blocks.append(_Block(tuple(starts), length, closed=False))
            opened += 1
        else:
            broken += 1
    return blocks, broken, opened


def _check_inputs(input_ids, attention_mask) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.is_floating_point():
        raise PipelineError(f"build_structure: input_ids must be an integer tensor [B, L], got "
                            f"{getattr(input_ids, 'shape', type(input_ids))}")
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise PipelineError(f"build_structure: attention_mask must be [B, L] like input_ids "
                            f"{tuple(input_ids.shape)}, got "
                            f"{getattr(attention_mask, 'shape', type(attention_mask))}")
    return attention_mask.to(device=input_ids.device, dtype=torch.bool)


def build_structure(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, tags: TagIds,
                    structured: bool = True, open_block: OpenBlock = "structured") -> Structure:
    """Path-window structure and multiverse position ids of a batch (padding may sit anywhere).

    With `structured=False`: plain causal + padding mask and ordinary positions (the Seen variant).
    """
    valid = _check_inputs(input_ids, attention_mask)
    batch, length = input_ids.shape
    device = input_ids.device
    hidden_start = torch.zeros(batch, length, dtype=torch.long)
    hidden_end = torch.zeros(batch, length, dtype=torch.long)
    shift = torch.zeros(batch, length, dtype=torch.long)  # position corrections, summed by cumsum
    broken = opened = 0
    if structured:
        valid_cpu = valid.cpu()
        before = torch.cat([torch.zeros(batch, 1, dtype=torch.long), valid_cpu.long().cumsum(1)], 1)
        is_tag = torch.isin(input_ids, tags.as_tensor(device)) & valid
        rows, cols = (t.tolist() for t in is_tag.nonzero(as_tuple=True))
        ids = input_ids[is_tag].tolist()
        per_row: list[list[tuple[int, int]]] = [[] for _ in range(batch)]
        for row, col, tag in zip(rows, cols, ids, strict=True):
            per_row[row].append((col, tag))
        for row, tag_seq in enumerate(per_row):
            blocks, n_broken, n_open = _parse_blocks(tag_seq, tags, length, open_block)
            broken, opened = broken + n_broken, opened + n_open
            for block in blocks:
                ends = block.path_starts[1:] + (block.end,)
                # a block without paths has ends == (end,): nothing to size
                sizes = [int(before[row, e] - before[row, s])
                         for s, e in zip(block.path_starts, ends, strict=False)]
                for i in range(1, len(sizes)):
                    hidden_start[row, block.path_starts[i]:ends[i]] = block.path_starts[0]
                    hidden_end[row, block.path_starts[i]:ends[i]] = block.path_starts[i]
                    shift[row, block.path_starts[i]] = sizes[i - 1]
                if block.closed and sizes:
                    shift[row, block.end] = sizes[-1] - max(sizes)
    steps = valid.long() - shift.to(device)
    position_ids = (steps.cumsum(1) - 1).masked_fill(~valid, 0)
    return Structure(position_ids=position_ids, broken_blocks=broken, open_blocks=opened, valid=valid,
                     hidden_start=hidden_start.to(device), hidden_end=hidden_end.to(device))


def attention_inputs(structure: Structure, attn_implementation: str, dtype: torch.dtype = torch.float32,
                     query_length: int | None = None) -> dict[str, object]:
    """Model-forward kwargs (`attention_mask`, `position_ids`) that `attn_implementation` uses as-is.

    `query_length` < L selects the last rows, for a forward over new tokens with a KV cache
    holding the earlier ones. The backend follows the model: "flex_attention" gets a BlockMask,
    "sdpa" a dense bool mask, "eager" a dense additive mask of `dtype`.
    """
    length = structure.position_ids.shape[1]
    q_len = query_length or length
    position_ids = structure.position_ids[:, length - q_len:]
    if attn_implementation == "flex_attention":
        mask = structure.block_mask(query_length=q_len)
    elif attn_implementation in ("sdpa", "sdpa_gqa"):  # sdpa_gqa: engine/attention.py
        mask = structure.dense_mask(q_len)
    elif attn_implementation == "eager":
        allowed = structure.dense_mask(q_len)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)
    else:
        raise PipelineError(f"structured attention: attn_implementation {attn_implementation!r} cannot take "
                            f"a custom mask; use one of {', '.join(ATTN_IMPLEMENTATIONS)}")
    return {"attention_mask": mask, "position_ids": position_ids}


@dataclass
class StructureStats:
    """What `structured_forward` saw: forward calls rewritten and blocks that fell back to causal."""

    calls: int = 0
    broken_blocks: int = 0
    open_blocks: int = 0
    _ids: torch.Tensor | None = field(default=None, repr=False)  # tokens seen since the last prefill


def _model_config(model: torch.nn.Module):
    for candidate in (model, getattr(model, "module", None)):  # DDP-style wrappers hold `.module`
        config = getattr(candidate, "config", None)
        if config is not None:
            return config
    raise PipelineError(f"structured_forward: {type(model).__name__} has no `.config`; pass "
                        "attn_implementation")


def _cached_length(past_key_values) -> int:
    return int(past_key_values.get_seq_length()) if past_key_values is not None else 0


@contextlib.contextmanager
def structured_forward(model: torch.nn.Module, tags: TagIds, structured: bool = True,
                       open_block: OpenBlock = "structured",
                       attn_implementation: str | None = None) -> Iterator[StructureStats]:
    """While active, every `model(input_ids=..., attention_mask=2D)` call runs with the structured
    mask and multiverse position ids (any `position_ids` passed are replaced).

    Works for full-sequence forwards (SFT, GRPO log-prob recomputation) and for cached decoding
    (`model.generate` with a DynamicCache, greedy or sampling): the hook keeps the tokens seen
    since the prefill call and builds the rows of the new tokens from the whole sequence.
    """
    impl = attn_implementation or _model_config(model)._attn_implementation
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    stats = StructureStats()

    def rewrite(module, args, kwargs):
        if len(args) > 1:
            raise PipelineError("structured_forward: pass everything but input_ids by keyword")
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise PipelineError("structured_forward: the call has no input_ids (tags must be visible)")
        mask_2d = kwargs.get("attention_mask")
        if mask_2d is not None and (not isinstance(mask_2d, torch.Tensor) or mask_2d.ndim != 2):
            raise PipelineError("structured_forward: expected a 2D padding attention_mask, got a prepared "
                                f"{type(mask_2d).__name__} (static caches / compiled generate are not "
                                "supported)")
        cached = _cached_length(kwargs.get("past_key_values"))
        if cached == 0:
            full_ids = input_ids
        elif stats._ids is not None and stats._ids.shape == (input_ids.shape[0], cached):
            full_ids = torch.cat([stats._ids, input_ids], dim=1)
        else:
            seen = None if stats._ids is None else tuple(stats._ids.shape)
            raise PipelineError(f"structured_forward: cache holds {cached} tokens but the hook saw {seen}; "
                                "activate it before the prefill call")
        if mask_2d is not None and mask_2d.shape[1] != full_ids.shape[1]:
            raise PipelineError(f"structured_forward: attention_mask covers {mask_2d.shape[1]} tokens, "
                                f"input_ids plus cache {full_ids.shape[1]}")
        structure = build_structure(full_ids, mask_2d, tags, structured=structured, open_block=open_block)
        stats._ids = full_ids
        stats.calls += 1
        stats.broken_blocks += structure.broken_blocks
        stats.open_blocks += structure.open_blocks
        kwargs = dict(kwargs)
        kwargs.update(attention_inputs(structure, impl, dtype, query_length=input_ids.shape[1]))
        if args:
            kwargs["input_ids"], args = input_ids, ()
        return args, kwargs

    handle = model.register_forward_pre_hook(rewrite, with_kwargs=True)
    try:
        yield stats
    finally:
        handle.remove()
