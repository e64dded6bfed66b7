"""The SFT probe: does a fine-tuned model write parallel blocks on held-out questions (greedy)?

Each variant is decoded the way it is meant to be used:
- Seen: free causal decoding (the engine without forking, greedy as `model.generate`): the model
  writes every tag itself, both paths included, so a well-formed block is entirely its own work.
- Unseen: the forking engine with structured attention, as RL and evaluation decode it (the
  official Parallel-R1 loop): the model opens a block with `<Parallel>`, ends each path with
  `</Path>` and its summary with `</Summary>`; the engine inserts `<Path>`, `</Parallel>` and
  `<Summary>` and runs the paths side by side under the path-window mask.
  For Unseen, free causal decoding (as Seen is decoded: plain causal attention, no forking) is also
  reported (`causal`), for reference: an Unseen model learnt to leave `<Path>`, `</Parallel>` and
  `<Summary>` to the engine, so alone it seldom writes a well-formed block (0-2 of 16 measured).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import torch

from parallel_r1.format import check_format, parallel_ratio
from parallel_r1.models import load_model, runs_in_bf16
from parallel_r1.prompts import render_prompt
from parallel_r1.rewards import is_correct

ENGINE_DECODING = ("greedy, forking engine with structured attention (the official loop: the engine inserts "
                   "<Path>, </Parallel>, <Summary>)")
CAUSAL_DECODING = "greedy, causal attention, no forking"


def probe_parallel_blocks(model_dir: str | os.PathLike, problems: Sequence[Mapping[str, str]],
                          max_new_tokens: int, *, variant: str = "seen", dtype: str = "float32",
                          n_examples: int = 2) -> dict[str, Any]:
    """How many of `problems` (question, ground_truth, answer_kind) get >= 1 well-formed block
    (`format.parallel_ratio`), decoded as `variant` is used; `dtype` as evaluation runs it
    (bfloat16 only where `runs_in_bf16`).

    Also reported, because they decide whether accuracy-based RL can get a gradient at all: the
    share of responses that end before `max_new_tokens` (a cut response has no final answer) and
    the share answered correctly (the paper checker)."""
    dtype = dtype if runs_in_bf16(dtype) else "float32"
    model, tokenizer = load_model(model_dir, dtype, attn_implementation="sdpa")
    model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    questions = [p["question"] for p in problems]
    causal = _report(*_greedy(model, tokenizer, questions, max_new_tokens, forking=False), problems,
                     max_new_tokens, CAUSAL_DECODING, n_examples)
    if variant != "unseen":
        return causal
    engine = _report(*_greedy(model, tokenizer, questions, max_new_tokens, forking=True), problems,
                     max_new_tokens, ENGINE_DECODING, n_examples)
    return {**engine, "causal": {key: causal[key] for key in
                                 ("decoding", "parallel_block_rate", "parallel_tag_rate", "format_check",
                                  "finished_rate", "accuracy")}}


Responses = tuple[list[str], list[int], list[bool]]  # texts, their token counts, cut by the cap


def _greedy(model, tokenizer, questions: Sequence[str], max_new_tokens: int, forking: bool) -> Responses:
    """Greedy responses of the engine: forking with Unseen's structured attention, or (forking=False)
    free causal decoding, where the model writes every tag itself.

    Causal decoding goes through the engine rather than `model.generate` for speed, with the same
    greedy tokens (tests/test_engine.py::test_plain_greedy_rollout_equals_model_generate): ~1.3x faster
    on a CPU, since a finished response leaves the batch and the KV cache grows in place.
    """
    from parallel_r1.engine import RolloutConfig, transformers_engine

    config = RolloutConfig(parallel=forking, structured=forking, temperature=0.0, max_tokens=max_new_tokens)
    # every question and its paths in one batch: none waits for a free row
    engine = transformers_engine(model, tokenizer, config, max_batch_size=len(questions) * config.num_paths)
    try:
        prompt_ids = [tokenizer(render_prompt(tokenizer, q), add_special_tokens=False)["input_ids"]
                      for q in questions]
        rollouts = engine.generate(prompt_ids, 1)
    finally:
        engine.close()
    return ([r.text for r in rollouts], [len(r.completion_ids) for r in rollouts],
            [r.truncated for r in rollouts])


def _report(texts: list[str], lengths: list[int], cut: list[bool], problems: Sequence[Mapping[str, str]],
            max_new_tokens: int, decoding: str, n_examples: int) -> dict[str, Any]:
    reasons: dict[str, int] = {}
    for text in texts:
        verdict = check_format(text)
        key = "ok" if verdict.ok else str(verdict.reason)
        reasons[key] = reasons.get(key, 0) + 1
    ranked = sorted(range(len(texts)), key=lambda i: not check_format(texts[i]).ok)  # well-formed first
    return {
        "questions": len(texts),
        "max_new_tokens": max_new_tokens,
        "decoding": decoding,
        "parallel_block_rate": parallel_ratio(texts),
        "parallel_tag_rate": sum("<Parallel>" in t for t in texts) / len(texts) if texts else 0.0,
        "format_check": dict(sorted(reasons.items())),
        "mean_response_tokens": sum(lengths) / len(lengths) if lengths else 0.0,
        "finished_rate": 1 - sum(cut) / len(cut) if cut else 0.0,
        "accuracy": sum(is_correct(text, p["ground_truth"], p["answer_kind"])
                        for text, p in zip(texts, problems, strict=True)) / len(texts) if texts else 0.0,
        "examples": [{"question": problems[i]["question"], "response": texts[i]}
                     for i in ranked[:n_examples]],
    }
