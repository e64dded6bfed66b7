"""KV forking and continuous scheduling of the transformers engine: ratios measured in one run.

Four comparisons on the tiny profile's random-init Qwen3 (real 152k vocabulary), same prompts
and seeds on both sides of each ratio:
  1. exact Unseen decoding, KV forking vs re-prefill (`kv_forking=False`: every segment re-encoded
     with the structured mask), at --lengths response tokens;
  2. parallel rollouts (4 blocks of 2 paths) vs plain rollouts of the same number of tokens, both
     KV forking: what the fork loop costs over plain decoding;
  3. one block's paths decoded side by side vs one after another (2 and 4 paths), from one
     forked context;
  4. continuous vs round-barrier scheduling on rollouts with mixed path lengths;
  5. prompts sharing their common prefix's encoding vs each row encoding its whole prompt, for
     --share-prompts different prompts x 1 rollout (an evaluation) and 2 prompts x 4 (GRPO groups),
     --share-length tokens each.
A random model does not write tags, so a logits processor scripts where they go (`Script`) and
bans the end-of-turn ids, so every rollout runs to its length; every other token is sampled.
"same tokens" compares the two sides token for token (same seeds). In float32 a rare False is
the sampler, not the cache: the random model's distributions are nearly flat over 152k tokens,
so a 1e-6 difference in summation order can move the inverse CDF across a token boundary
(tests/test_kv_forking.py proves exactness in float64).

Each side of a ratio runs --repeats times, alternating with the other; its fastest run counts.
Prints one table per comparison (--only: some of them) and writes metrics/bench/kv_forking.json.

    python benchmarks/kv_forking.py                        # the default sizes (CPU: a few minutes)
    python benchmarks/kv_forking.py --lengths 512 --rollouts 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel_r1.engine import RolloutConfig, transformers_engine  # noqa: E402
from parallel_r1.engine.base import KVSpan, SegmentRequest  # noqa: E402
from parallel_r1.models import (  # noqa: E402
    TinyModelConfig,
    build_tiny_model,
    load_model,
    load_tokenizer,
    qwen3_tokenizer_dir,
)
from parallel_r1.prompts import render_prompt  # noqa: E402
from parallel_r1.structure import TagIds  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "metrics", "bench",
                   "kv_forking.json")
QUESTIONS = ["What is 2 + 3?", "A farmer has 12 cows and buys 7 more. How many cows does he have?",
             "Tom reads 15 pages a day. How many pages does he read in a week?",
             "A shirt costs $20 and is 25% off. What does it cost?"]


class Script:
    """Places the tags: `<Parallel>` after `main` tokens of main text, `</Path>` after a path's
    length, `</Summary>` after `summary` tokens; bans `banned` (the end-of-turn ids) always.

    A path's length is `path`, or with `mixed` 8 + (its first token mod `path`), so paths of one
    block end at different steps. Reads only the last `window` tokens of each row (cheap)."""

    def __init__(self, tokenizer, tags: TagIds, banned, main: int, path: int, summary: int, mixed=False):
        self.tags, self.main, self.path, self.summary, self.mixed = tags, main, path, summary, mixed
        self.start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.special = torch.tensor([tags.parallel_open, tags.parallel_close, tags.path_open, tags.path_close,
                                     tags.summary_open, tags.summary_close, self.start])
        self.banned = sorted(banned)
        self.window = max(main, path, summary) + 16

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[:, self.special] = float("-inf")
        scores[:, self.banned] = float("-inf")
        tail = input_ids[:, -self.window:]
        marked = torch.isin(tail, self.special)
        last = tail.shape[1] - 1 - marked.flip(1).long().argmax(1)
        for row in range(tail.shape[0]):
            if not bool(marked[row].any()):
                continue
            mark, since = int(tail[row, last[row]]), int(tail.shape[1] - 1 - last[row])
            wanted = self._wanted(mark, since, tail[row, last[row] + 1:])
            if wanted is not None:
                scores[row, wanted] = scores[row].max() + 100.0
        return scores

    def _wanted(self, mark: int, since: int, after: torch.Tensor) -> int | None:
        tags = self.tags
        if mark == tags.path_open and since >= 1:
            length = 8 + int(after[0]) % self.path if self.mixed else self.path
            return tags.path_close if since >= length else None
        if mark == tags.summary_open and since >= self.summary:
            return tags.summary_close
        if mark == self.start and since >= self.main + 2:  # after "<|im_start|>assistant\n"
            return tags.parallel_open
        if mark == tags.summary_close and since >= self.main:
            return tags.parallel_open
        return None


def setup(model_dir: str | None = None) -> tuple[tuple[Any, Any, TagIds], list[list[int]]]:
    """The tiny random-init Qwen3, or the model folder `model_dir` (e.g. the small profile's models/base)."""
    if model_dir:
        model, tokenizer = load_model(model_dir, "float32")
        model.eval()
    else:
        tokenizer = load_tokenizer(qwen3_tokenizer_dir())
        model = build_tiny_model(tokenizer, TinyModelConfig()).eval()
    prompts = [tokenizer(render_prompt(tokenizer, q), add_special_tokens=False)["input_ids"]
               for q in QUESTIONS]
    return (model, tokenizer, TagIds.from_tokenizer(tokenizer)), prompts


def timed_rollouts(model, tokenizer, tags, prompts, length: int, kv_forking=True, parallel=True, mixed=False,
                   backend=None, paths=2, generations=1, share_prompts=True):
    """Rollouts of `length` tokens (4 blocks when parallel); seconds, tokens, the rollouts."""
    config = RolloutConfig(parallel=parallel, num_paths=paths, max_blocks=4, max_tokens=length,
                           temperature=1.0, structured=True, seed=1)
    engine = transformers_engine(model, tokenizer, config, kv_forking=kv_forking, **(backend or {}))
    backend_: Any = engine.backend  # TransformersBackend or ForkingTransformersBackend
    backend_.share_prompts = share_prompts
    segment = max(8, length // 16)
    backend_.logits_processor = Script(tokenizer, tags, engine.eos_ids, main=segment, path=segment,
                                             summary=max(4, segment // 2), mixed=mixed)
    started = time.perf_counter()
    rollouts = engine.generate(prompts, generations)
    seconds = time.perf_counter() - started
    return seconds, sum(len(r.completion_ids) for r in rollouts), rollouts


def fastest_of(repeats: int, *sides):
    """Each side's fastest of `repeats` runs, the sides alternating (first item of a run: seconds).

    Why: on a shared machine a busy moment slows one run by up to 2x; alternating and keeping each
    side's best measures the code, not the neighbours.
    """
    best: list = [None] * len(sides)
    for _ in range(repeats):
        for index, side in enumerate(sides):
            result = side()
            if best[index] is None or result[0] < best[index][0]:
                best[index] = result
    return best


def same_tokens(a, b) -> bool:
    return all(x.completion_ids == y.completion_ids for x, y in zip(a, b, strict=True))


def forking_vs_reprefill(setup_: tuple[Any, Any, TagIds], args) -> list[dict]:
    rows = []
    for length in args.lengths:
        (prefill_s, tokens, reference), (forked_s, _, forked) = fastest_of(
            args.repeats, partial(timed_rollouts, *setup_, args.prompts_list, length, kv_forking=False),
            partial(timed_rollouts, *setup_, args.prompts_list, length))
        rows.append(dict(length=length, tokens=tokens, blocks=sum(r.num_blocks for r in forked),
                         reprefill_s=prefill_s, forked_s=forked_s, speedup=prefill_s / forked_s,
                         same_tokens=same_tokens(forked, reference)))
    return rows


def parallel_vs_plain(setup_: tuple[Any, Any, TagIds], args) -> dict:
    length = args.plain_length
    (parallel_s, tokens, rollouts), (plain_s, plain_tokens, _) = fastest_of(
        args.repeats, partial(timed_rollouts, *setup_, args.prompts_list, length),
        partial(timed_rollouts, *setup_, args.prompts_list, length, parallel=False))
    return dict(length=length, parallel_tokens=tokens, plain_tokens=plain_tokens,
                blocks=sum(r.num_blocks for r in rollouts), parallel_s=parallel_s, plain_s=plain_s,
                parallel_tok_s=tokens / parallel_s, plain_tok_s=plain_tokens / plain_s,
                overhead=(plain_tokens / plain_s) / (tokens / parallel_s) - 1.0)


def side_by_side(setup_: tuple[Any, Any, TagIds], args) -> list[dict]:
    model, tokenizer, tags = setup_
    prompts = args.prompts_list
    rows = []
    for paths in (2, 4):
        engine = transformers_engine(model, tokenizer, RolloutConfig(), max_batch_size=paths)
        backend = engine.backend
        context = tuple(prompts[0])
        run(backend, [SegmentRequest(context, 1, frozenset(), kv_key="ctx")])
        requests = [SegmentRequest(context + (tags.parallel_open, tags.path_open), args.path_tokens,
                                   frozenset(), seed=seed, kv_spans=(KVSpan("ctx", 0, len(context)),))
                    for seed in range(paths)]
        (together_s, together), (alone_s, alone) = fastest_of(
            args.repeats, partial(timed, partial(run, backend, requests)),
            partial(timed, partial(one_by_one, backend, requests)))
        rows.append(dict(paths=paths, path_tokens=args.path_tokens, side_by_side_s=together_s,
                         one_after_another_s=alone_s, speedup=alone_s / together_s,
                         same_tokens=[r.token_ids for r in together] == [r.token_ids for r in alone]))
    return rows


def timed(work):
    started = time.perf_counter()
    result = work()
    return time.perf_counter() - started, result


def one_by_one(backend, requests):
    return [run(backend, [request])[0] for request in requests]


def run(backend, requests):
    tickets = [backend.submit(request) for request in requests]
    done = {}
    while len(done) < len(tickets):
        done.update(backend.step())
    return [done[ticket] for ticket in tickets]


def continuous_vs_rounds(setup_: tuple[Any, Any, TagIds], args) -> dict:
    length = args.mixed_length
    options = dict(mixed=True, paths=3, generations=2)
    (rounds_s, tokens, rounds), (continuous_s, _, continuous) = fastest_of(
        args.repeats,
        partial(timed_rollouts, *setup_, args.prompts_list, length, backend=dict(scheduling="rounds"),
                **options),
        partial(timed_rollouts, *setup_, args.prompts_list, length, backend=dict(scheduling="continuous"),
                **options))
    return dict(length=length, rollouts=len(rounds), tokens=tokens, rounds_s=rounds_s,
                continuous_s=continuous_s, speedup=rounds_s / continuous_s,
                same_tokens=same_tokens(continuous, rounds))


def shared_vs_own_prompts(setup_: tuple[Any, Any, TagIds], args) -> list[dict]:
    model, tokenizer, _ = setup_
    questions = [f"{q} (problem {n})" for n in range(4) for q in QUESTIONS][:args.share_prompts]
    many = [tokenizer(render_prompt(tokenizer, q), add_special_tokens=False)["input_ids"] for q in questions]
    rows = []
    for label, prompts, generations in ((f"{len(many)} x 1", many, 1), ("2 x 4", many[:2], 4)):
        (own_s, tokens, own), (shared_s, _, shared) = fastest_of(
            args.repeats,
            partial(timed_rollouts, *setup_, prompts, args.share_length, generations=generations,
                    share_prompts=False),
            partial(timed_rollouts, *setup_, prompts, args.share_length, generations=generations))
        rows.append(dict(rollouts=label, prompt_tokens=sum(map(len, prompts)) * generations, tokens=tokens,
                         own_s=own_s, shared_s=shared_s, speedup=own_s / shared_s,
                         same_tokens=same_tokens(shared, own)))
    return rows


def print_table(columns, rows) -> None:
    """One line per row: (header, width, key, format) per column; a speed-up column gets an "x"."""
    print("".join(f"{header:>{width}}" for header, width, _, _ in columns))
    for r in rows:
        print("".join(f"{format(r[key], spec)}{'x' if key == 'speedup' else ''}".rjust(width)
                      for _, width, key, spec in columns))


def print_forking(rows, args) -> None:
    print(f"1. exact Unseen, KV forking vs re-prefill ({args.rollouts} rollouts, 4 blocks x 2 paths)")
    print_table([("tokens", 8, "length", ""), ("blocks", 8, "blocks", ""),
                 ("re-prefill s", 14, "reprefill_s", ".2f"), ("forked s", 10, "forked_s", ".2f"),
                 ("speed-up", 10, "speedup", ".2f"), ("same tokens", 13, "same_tokens", "")], rows)


def print_plain(r, args) -> None:
    print(f"\n2. parallel (4 blocks x 2 paths) vs plain rollouts, {r['length']} tokens each, KV forking")
    print(f"parallel {r['parallel_tok_s']:.1f} tok/s, plain {r['plain_tok_s']:.1f} tok/s: "
          f"fork loop overhead {100 * r['overhead']:+.1f}% ({r['blocks']} blocks)")


def print_side_by_side(rows, args) -> None:
    print(f"\n3. one block's paths ({args.path_tokens} tokens each) side by side vs one after another")
    print_table([("paths", 6, "paths", ""), ("together s", 12, "side_by_side_s", ".2f"),
                 ("one by one s", 14, "one_after_another_s", ".2f"), ("speed-up", 10, "speedup", ".2f"),
                 ("same tokens", 13, "same_tokens", "")], rows)


def print_continuous(r, args) -> None:
    print(f"\n4. continuous vs round-barrier scheduling, {r['rollouts']} rollouts x {r['length']} tokens, "
          f"3 paths of mixed lengths")
    print(f"rounds {r['rounds_s']:.2f} s, continuous {r['continuous_s']:.2f} s: {r['speedup']:.2f}x, "
          f"same tokens {r['same_tokens']}")


def print_shared(rows, args) -> None:
    print(f"\n5. prompts sharing their common prefix vs each encoding its own, "
          f"{args.share_length} tokens each")
    print_table([("rollouts", 10, "rollouts", ""), ("prompt tokens", 15, "prompt_tokens", ""),
                 ("own s", 9, "own_s", ".2f"), ("shared s", 10, "shared_s", ".2f"),
                 ("speed-up", 10, "speedup", ".2f"), ("same tokens", 13, "same_tokens", "")], rows)


SECTIONS = {"forking_vs_reprefill": (forking_vs_reprefill, print_forking),
            "parallel_vs_plain": (parallel_vs_plain, print_plain),
            "side_by_side": (side_by_side, print_side_by_side),
            "continuous_vs_rounds": (continuous_vs_rounds, print_continuous),
            "shared_prompts": (shared_vs_own_prompts, print_shared)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 3000])
    parser.add_argument("--rollouts", type=int, default=2, help="prompts (one rollout each) for 1, 2 and 4")
    parser.add_argument("--plain-length", type=int, default=1024)
    parser.add_argument("--mixed-length", type=int, default=1024)
    parser.add_argument("--path-tokens", type=int, default=128)
    parser.add_argument("--share-prompts", type=int, default=16, help="different prompts for 5 (at most 16)")
    parser.add_argument("--share-length", type=int, default=64)
    parser.add_argument("--model", default=None,
                        help="a model folder with the tags (e.g. models/base of the small profile: "
                             "SmolLM2-135M, 30 layers, where re-encoding costs what it does in a real "
                             "model); default: the tiny random-init Qwen3, whose 152k-token LM head "
                             "dominates every step")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each side, alternating; each side's fastest counts (shared machines)")
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS), default=list(SECTIONS),
                        help="the comparisons to run (default: all five)")
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args()
    torch.manual_seed(0)
    setup_, prompts = setup(args.model)
    args.prompts_list = prompts[:args.rollouts]
    timed_rollouts(*setup_, args.prompts_list[:1], 64)  # warm-up
    timed_rollouts(*setup_, args.prompts_list[:1], 64, kv_forking=False)
    results = dict(model=args.model or f"tiny Qwen3 {TinyModelConfig()}", device=str(setup_[0].device),
                   threads=torch.get_num_threads(), rollouts=args.rollouts, repeats=args.repeats)
    for name in args.only:
        results[name] = SECTIONS[name][0](setup_, args)
        SECTIONS[name][1](results[name], args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
