"""What a rollout engine is asked for and what it returns, and the calls a backend serves.

The fork logic (loop.py) talks to a backend through "continue these token sequences". Every
segment of every rollout — main text, the N paths of a block, the summary — becomes one
`SegmentRequest` carrying the full token ids so far, so a backend needs no notion of paths or
blocks. Two ways to serve them:
  - `Backend.continue_batch`: one blocking batched call (a round: the loop waits for the longest
    segment). vLLM shares the common prefix through its prefix cache.
  - `StreamingBackend.submit` / `step`: requests join and leave a running decode batch every step,
    so a rollout moves on as soon as its segment ends. The KV-forking transformers backend serves
    this way and keeps each segment's KV cache for the next (`SegmentRequest.kv_key`/`kv_spans`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable, Literal, Protocol, Sequence

from parallel_r1.config import check_fields
from parallel_r1.errors import PipelineError

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class RolloutConfig:
    """How responses are sampled and how parallel blocks are forked.

    Forking:
        parallel: fork at `<Parallel>` (the official Parallel-R1 loop). False = one plain
            sequence, `<Parallel>` is an ordinary token (baselines, teacher generation).
        num_paths: independent `<Path>`s generated per block (official default 2).
        max_blocks: blocks per response (official default 4). Once this many blocks are done,
            `<Parallel>` is banned (its logit masked) in the main text, so the model keeps
            reasoning to a final answer. The official v3 loop instead *ends the response* after
            the K-th block, which cuts off the final answer; we do not copy that.
        max_tokens: cap on the whole completion, every token counted (main text, all paths,
            summaries and the tags the engine inserts). A block is only forked when its paths
            and summary fit: each path gets an equal share of what is left.
        structured: the Unseen variant: paths and summary decoded with the path-window mask and
            multiverse positions (exact in the transformers backend; vLLM cannot, see
            vllm_backend.py). False = ordinary causal attention (Seen).

    Sampling (the same for main text, paths and summary):
        temperature: 0 = greedy. top_p: nucleus mass in (0, 1].
        seed: seeds the per-request sampler seeds (same seed, same rollouts on one backend).
    """

    parallel: bool = True
    num_paths: int = field(default=2, metadata={"min": 2})
    max_blocks: int = field(default=4, metadata={"min": 0})
    max_tokens: int = field(default=3000, metadata={"min": 1})
    temperature: float = field(default=1.0, metadata={"min": 0.0})
    top_p: float = 1.0
    structured: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self)
        if not math.isfinite(self.temperature):
            raise PipelineError(f"temperature: must be finite, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise PipelineError(f"top_p: must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class Rollout:
    """One sampled response, in the shape TRL's `rollout_func` returns it.

    completion_ids: every token of the response in reading order (paths one after the other).
    logprobs: per completion token, the log-prob it was sampled with (after temperature, top-p
        and bans, as vLLM's "processed_logprobs"); 0.0 for tokens the engine inserted.
    env_mask: 1 = sampled by the model, 0 = inserted by the engine (`<Path>` at each fork,
        `</Parallel>`, the newline and `<Summary>` after the paths, and a `</Path>` or
        `</Summary>` closing a segment cut by EOS or by its budget). TRL leaves 0s out of the loss.
    text: the completion decoded with the tags kept (EOS and padding dropped); TRL decodes with
        skip_special_tokens=True, which strips the tags, so rewards read this text.
    truncated: the token cap ended the response. num_blocks: blocks completed (summary closed).
    finish_reason: "stop" (EOS) or "length" (the cap).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    env_mask: list[int]
    text: str
    truncated: bool
    num_blocks: int
    finish_reason: FinishReason


@dataclass(frozen=True)
class SegmentRequest:
    """Continue `token_ids` (prompt and completion so far) by at most `max_new_tokens` tokens.

    Generation stops after the first token in `stop_ids` (that token is returned); tokens in
    `banned_ids` are never sampled. `structured` asks for the path-window mask and multiverse
    positions over `token_ids`; `seed` seeds this request's own sampler, so its tokens do not
    depend on which other requests share the batch.

    KV hints, for backends that keep caches between segments (the others ignore them):
    `kv_key` names this segment's KV (its token_ids and the tokens it generates) for later
    requests; `kv_spans` says where earlier kept KV lies in `token_ids` (see `KVSpan`). A hint
    only says where to look: the backend reuses a cached column only where it is provably what
    encoding `token_ids` from scratch would compute, so a wrong hint costs speed, never exactness.
    """

    token_ids: tuple[int, ...]
    max_new_tokens: int
    stop_ids: frozenset[int]
    banned_ids: frozenset[int] = frozenset()
    structured: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    kv_key: Hashable | None = None
    kv_spans: tuple[KVSpan, ...] = ()


@dataclass(frozen=True)
class KVSpan:
    """The next `length` tokens of a request continue kept segment `key` from its token `start` on.

    A request's spans are consecutive from its first token. The first continues a segment from its
    start (`start` = 0); a later one reuses a segment that forked from the first at `start`
    (a path, after the shared context): its columns `[start, start + length)` sit here. Tokens of
    the span the segment does not hold yet (a path's closing `</Path>`) are encoded in that
    segment's own context before the join.
    """

    key: Hashable
    start: int
    length: int


@dataclass(frozen=True)
class SegmentResult:
    """New tokens of one request, their sampling log-probs, and whether a stop id ended it."""

    token_ids: list[int]
    logprobs: list[float]
    stopped: bool


class Backend(Protocol):
    """A generation backend: one batched continuation call, plus weight sync and shutdown."""

    def continue_batch(self, requests: Sequence[SegmentRequest]) -> list[SegmentResult]:
        """One result per request, in order."""

    def sync_weights(self, model) -> None:
        """Make generation use `model`'s current weights (GRPO calls this once per step)."""

    def close(self) -> None:
        """Free the backend's processes and memory."""


class StreamingBackend(Backend, Protocol):
    """A backend that decodes requests as a running batch: rows join and retire every step.

    It may also have `drain()`, which the rollout loop calls at the end of every `generate` call
    (the transformers backend pairs other processes' forwards there under FSDP: engine/lockstep.py).
    """

    def submit(self, request: SegmentRequest) -> int:
        """Queue `request`; returns its ticket."""

    def step(self) -> list[tuple[int, SegmentResult]]:
        """Admit queued requests, decode one token for every row; (ticket, result) of each that ended."""

    def release(self, keys: Sequence[Hashable]) -> None:
        """Drop the KV kept under `keys` (no later request will name them)."""
