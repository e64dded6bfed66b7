"""The official Parallel-R1 rollout loop, as a per-rollout state machine driven by segment results.

Each rollout runs (zhengkid/Parallel-R1, parallel_thinking_loop_v3.py):
  main   generate until `<Parallel>`, EOS or the cap;
  paths  at `<Parallel>`, fork `num_paths` requests, each the shared context + `<Path>`, each
         stopped at `</Path>` (EOS or the path budget: the engine closes it with `</Path>`);
  summary append `</Parallel>`, a newline and `<Summary>`, generate the summary conditioned on
         all paths until `</Summary>` (closed by the engine on EOS or budget); back to main.
A rollout's next segment is submitted as soon as its current one has ended (for paths: all of
its block's paths), so with a streaming backend (the KV-forking transformers one, offline vLLM)
rollouts never wait for each other; a batch-only backend (the `trl vllm-serve` client) is driven
in rounds by `_RoundBarrier`. Paths of one block, and segments of different rollouts, decode side
by side either way.

Paths are separate requests from the same context: a path never sees its siblings and starts
at pos(`<Parallel>`) + 1 — the multiverse layout — in every backend. What differs is the
summary and later text: the transformers backend decodes them with the structured mask when
`config.structured` (exact Unseen), vLLM with causal attention.

Each request names its KV (`kv_key`) and where the KV of earlier segments lies in its tokens
(`kv_spans`): a path forks the context; an Unseen summary reuses the context and every path's
own KV (a Seen summary reuses the context and the first path: the backend checks which columns
equal a re-encoding). Seeds are derived from (call, rollout, segment, path), not drawn in
scheduling order, so the same seed gives the same tokens however the backend batches.

Where we differ from the official loop, and why:
  - after `max_blocks` blocks `<Parallel>` is banned instead of ending the response (the
    official loop stops generating, cutting off the final answer);
  - inserted tokens get env_mask 0 (the official response mask trains on them);
  - the cap counts every token and is never exceeded: a block is forked only when each path
    can get >= 1 sampled token and the summary its tags, else the response ends as truncated.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence, cast

from parallel_r1.engine.base import (
    Backend,
    FinishReason,
    KVSpan,
    Rollout,
    RolloutConfig,
    SegmentRequest,
    SegmentResult,
    StreamingBackend,
)
from parallel_r1.errors import PipelineError
from parallel_r1.format import SUMMARY_SEPARATOR  # official: `</Parallel>` "\n" `<Summary>`
from parallel_r1.structure import TagIds

MAIN, PATHS, SUMMARY, DONE = "main", "paths", "summary", "done"


@dataclass
class _State:
    """One rollout in progress."""

    prompt_ids: tuple[int, ...]
    completion: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    phase: str = MAIN
    num_blocks: int = 0
    path_budget: int = 0  # new tokens each path request may sample
    summary_budget: int = 0
    truncated: bool = False
    finish_reason: FinishReason = "stop"
    index: int = 0  # rollout number within its `generate` call
    segments: int = 0  # requests issued so far (seeds and KV keys derive from it)
    waiting: list[SegmentResult | None] = field(default_factory=list)  # the in-flight segments' results
    context_key: Hashable | None = None  # KV of the text before the current segment (main or summary)
    path_keys: list[Hashable] = field(default_factory=list)
    kept: list[Hashable] = field(default_factory=list)  # keys whose KV the backend may still hold
    block_start: int = 0  # tokens (prompt + completion) up to and including `<Parallel>`
    path_lengths: list[int] = field(default_factory=list)  # each path's tokens, `<Path>` to `</Path>`

    def sampled(self, tokens: Sequence[int], logprobs: Sequence[float]) -> None:
        self.completion.extend(tokens)
        self.logprobs.extend(logprobs)
        self.env_mask.extend([1] * len(tokens))

    def inserted(self, tokens: Iterable[int]) -> None:
        tokens = list(tokens)
        self.completion.extend(tokens)
        self.logprobs.extend([0.0] * len(tokens))
        self.env_mask.extend([0] * len(tokens))

    def finish(self, reason: FinishReason) -> None:
        self.phase, self.finish_reason, self.truncated = DONE, reason, reason == "length"


def default_eos_ids(tokenizer, generation_eos: int | Sequence[int] | None = None) -> frozenset[int]:
    """EOS ids as TRL's GRPOTrainer takes them: the tokenizer's plus the generation config's."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    ids.update([generation_eos] if isinstance(generation_eos, int) else (generation_eos or []))
    if not ids:
        raise PipelineError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')}: no EOS token to stop "
                            "generation")
    return frozenset(ids)


class RolloutEngine:
    """Samples (parallel) responses for token prompts through a `Backend`."""

    def __init__(self, backend: Backend, tokenizer, config: RolloutConfig,
                 eos_token_ids: Iterable[int] | None = None) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.config = config
        self.tags = TagIds.from_tokenizer(tokenizer)
        self.eos_ids = frozenset(eos_token_ids) if eos_token_ids is not None else default_eos_ids(tokenizer)
        hidden = set(self.eos_ids)
        if tokenizer.pad_token_id is not None:
            hidden.add(tokenizer.pad_token_id)
        self._hidden_in_text = frozenset(hidden)
        self.separator = tuple(tokenizer.encode(SUMMARY_SEPARATOR, add_special_tokens=False))
        self._seeds = random.Random(config.seed)  # one draw per `generate` call
        self._call_seed = 0
        # after the paths: `</Parallel>`, separator, `<Summary>`, and room for `</Summary>`
        self._after_paths = 3 + len(self.separator)

    # ------------------------------------------------------------------ public API

    def generate(self, prompt_ids: Sequence[Sequence[int]], num_generations: int = 1,
                 call: int | None = None) -> list[Rollout]:
        """`num_generations` rollouts per prompt, grouped per prompt consecutively (TRL's order).

        `call` keys this call's sampler seeds (with config.seed) instead of the count of earlier calls:
        GRPO passes the trainer's step, so a run resumed from a checkpoint samples what the
        uninterrupted run sampled at that step.
        """
        if num_generations < 1:
            raise PipelineError(f"rollout engine: num_generations must be >= 1, got {num_generations}")
        for index, ids in enumerate(prompt_ids):
            if len(ids) == 0:
                raise PipelineError(f"rollout engine: prompt {index} has no tokens")
        prompts = [tuple(int(t) for t in ids) for ids in prompt_ids for _ in range(num_generations)]
        states = [_State(prompt, index=index) for index, prompt in enumerate(prompts)]
        self._call_seed = (self._seeds.getrandbits(63) if call is None
                           else random.Random(f"{self.config.seed}:{call}").getrandbits(63))
        # a backend with `step` streams (StreamingBackend); a batch-only one is driven in rounds
        scheduler: StreamingBackend | _RoundBarrier = (cast(StreamingBackend, self.backend)
                                                       if hasattr(self.backend, "step")
                                                       else _RoundBarrier(self.backend))
        in_flight: dict[int, tuple[_State, int]] = {}

        def submit(state: _State) -> None:
            requests = self._requests(state)
            state.waiting = [None] * len(requests)
            for slot, request in enumerate(requests):
                in_flight[scheduler.submit(request)] = (state, slot)
            needed = {span.key for request in requests for span in request.kv_spans}
            scheduler.release([key for key in state.kept if key not in needed])
            state.kept = [key for key in state.kept if key in needed]

        for state in states:
            submit(state)
        while in_flight:
            for ticket, result in scheduler.step():
                state, slot = in_flight.pop(ticket)
                state.waiting[slot] = result
                state.kept.append(self._key(state, state.segments - 1, slot))
                done = [r for r in state.waiting if r is not None]
                if len(done) == len(state.waiting):
                    self._advance(state, done)
                    submit(state)
        drain = getattr(scheduler, "drain", None)  # a sharded policy: wait for the other processes
        if drain is not None:
            drain()
        return [self._rollout(state) for state in states]

    def sync_weights(self, model) -> None:
        """Generate with `model`'s current weights from now on."""
        self.backend.sync_weights(model)

    def close(self) -> None:
        self.backend.close()

    # ------------------------------------------------------------------ the state machine

    def _remaining(self, state: _State) -> int:
        return self.config.max_tokens - len(state.completion)

    def _key(self, state: _State, segment: int, slot: int) -> tuple[int, int, int, int]:
        """Names a request: its KV key, and what its sampler seed is derived from."""
        return (self._call_seed, state.index, segment, slot)

    def _request(self, state: _State, slot: int, extra: Sequence[int], budget: int, stop: set[int],
                 banned: frozenset[int] = frozenset(), spans: tuple[KVSpan, ...] = ()) -> SegmentRequest:
        key = self._key(state, state.segments, slot)
        return SegmentRequest(
            token_ids=state.prompt_ids + tuple(state.completion) + tuple(extra), max_new_tokens=budget,
            stop_ids=frozenset(stop), banned_ids=banned, structured=self.config.structured,
            temperature=self.config.temperature, top_p=self.config.top_p, seed=_derived_seed(key),
            kv_key=key, kv_spans=spans)

    def _requests(self, state: _State) -> list[SegmentRequest]:
        """The requests of `state`'s current phase, with the KV hints that let a backend fork."""
        length = len(state.prompt_ids) + len(state.completion)
        context = (KVSpan(state.context_key, 0, length),) if state.context_key is not None else ()
        if state.phase == MAIN:
            stop, banned = set(self.eos_ids), frozenset[int]()
            if self.config.parallel:
                if state.num_blocks < self.config.max_blocks:
                    stop.add(self.tags.parallel_open)
                else:
                    banned = frozenset({self.tags.parallel_open})
            requests = [self._request(state, 0, (), self._remaining(state), stop, banned, context)]
        elif state.phase == PATHS:
            stop = set(self.eos_ids) | {self.tags.path_close}
            requests = [self._request(state, slot, (self.tags.path_open,), state.path_budget, stop,
                                      spans=context) for slot in range(self.config.num_paths)]
        elif state.phase == SUMMARY:
            stop = set(self.eos_ids) | {self.tags.summary_close}
            paths = zip(state.path_keys, state.path_lengths, strict=True)
            spans = (KVSpan(state.context_key, 0, state.block_start),
                     *(KVSpan(key, state.block_start, length) for key, length in paths))
            requests = [self._request(state, 0, (), state.summary_budget, stop, spans=spans)]
        else:
            return []
        state.segments += 1
        return requests

    def _advance(self, state: _State, results: list[SegmentResult]) -> None:
        keys: list[Hashable] = [self._key(state, state.segments - 1, slot) for slot in range(len(results))]
        if state.phase == MAIN:
            state.context_key = keys[0]
            self._after_main(state, results[0])
        elif state.phase == PATHS:
            state.path_keys = keys
            self._after_paths_done(state, results)
        elif state.phase == SUMMARY:
            state.context_key, state.path_keys, state.path_lengths = keys[0], [], []
            self._close_segment(state, results[0], self.tags.summary_close)
            state.num_blocks += 1
            self._resume(state)

    def _after_main(self, state: _State, result: SegmentResult) -> None:
        state.sampled(result.token_ids, result.logprobs)
        forks = (self.config.parallel and result.stopped and result.token_ids
                 and result.token_ids[-1] == self.tags.parallel_open)
        if not forks:
            state.finish("stop" if result.stopped else "length")
            return
        # Each path: `<Path>` + >= 1 sampled token + room for an inserted `</Path>`.
        share = (self._remaining(state) - self._after_paths) // self.config.num_paths
        if share < 3:
            state.finish("length")  # the block cannot fit under the cap
            return
        state.path_budget, state.phase = share - 2, PATHS

    def _after_paths_done(self, state: _State, results: list[SegmentResult]) -> None:
        state.block_start = len(state.prompt_ids) + len(state.completion)
        for result in results:
            before = len(state.completion)
            state.inserted((self.tags.path_open,))
            self._close_segment(state, result, self.tags.path_close)
            state.path_lengths.append(len(state.completion) - before)
        state.inserted((self.tags.parallel_close, *self.separator, self.tags.summary_open))
        room = self._remaining(state) - 1  # keep one token for `</Summary>`
        if room >= 1:
            state.summary_budget, state.phase = room, SUMMARY
            return
        state.inserted((self.tags.summary_close,))
        state.num_blocks += 1
        state.context_key, state.path_keys, state.path_lengths = None, [], []  # no summary KV to continue
        self._resume(state)

    def _close_segment(self, state: _State, result: SegmentResult, closing: int) -> None:
        """Append a path or summary; a segment cut by EOS or its budget gets `closing` inserted.

        A sampled EOS inside a path or summary is dropped and replaced by the closing tag, as the
        official loop does (the response must not end inside a block).
        """
        tokens, logprobs = list(result.token_ids), list(result.logprobs)
        if result.stopped and tokens and tokens[-1] == closing:
            state.sampled(tokens, logprobs)
            return
        if result.stopped and tokens and tokens[-1] in self.eos_ids:
            tokens, logprobs = tokens[:-1], logprobs[:-1]
        state.sampled(tokens, logprobs)
        state.inserted((closing,))

    def _resume(self, state: _State) -> None:
        if self._remaining(state) <= 0:
            state.finish("length")
        else:
            state.phase = MAIN

    def _rollout(self, state: _State) -> Rollout:
        shown = [t for t in state.completion if t not in self._hidden_in_text]
        return Rollout(
            prompt_ids=list(state.prompt_ids), completion_ids=list(state.completion),
            logprobs=list(state.logprobs), env_mask=list(state.env_mask),
            text=self.tokenizer.decode(shown, skip_special_tokens=False),
            truncated=state.truncated, num_blocks=state.num_blocks, finish_reason=state.finish_reason)


def _derived_seed(key: tuple) -> int:
    """A request's sampler seed from its (call seed, rollout, segment, path): independent of scheduling."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _RoundBarrier:
    """Drives a batch-only backend (`continue_batch`) through the streaming calls: each `step`
    serves everything submitted since the last one in one blocking call (a round)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._queued: list[tuple[int, SegmentRequest]] = []
        self._tickets = itertools.count()

    def submit(self, request: SegmentRequest) -> int:
        ticket = next(self._tickets)
        self._queued.append((ticket, request))
        return ticket

    def step(self) -> list[tuple[int, SegmentResult]]:
        queued, self._queued = self._queued, []
        results = self.backend.continue_batch([request for _, request in queued]) if queued else []
        if len(results) != len(queued):
            raise PipelineError(f"rollout backend returned {len(results)} results for {len(queued)} requests")
        return [(ticket, result) for (ticket, _), result in zip(queued, results, strict=True)]

    def release(self, keys: Sequence[Hashable]) -> None:
        """Nothing is kept between rounds."""
