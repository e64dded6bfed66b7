"""Which accelerate config fits which policy: replicated training holds the whole fp32 state per GPU.

Policies train with float32 weights; the accelerate configs' `mixed_precision: bf16` runs the
forward and backward passes in bf16. Weights stored in bf16 would not train at the paper's lr:
bf16 keeps 8 significant bits, so a weight of 0.02 only moves in steps of ~8e-5, and an AdamW
step at lr 1e-6 (~1e-6 per weight) is rounded away. So DDP (configs/ddp.yaml) and one GPU hold
weights, gradients and AdamW's two moments in float32 on every GPU: 16 bytes per parameter,
~64 GB for Qwen3-4B before activations and vLLM's share, more than an 80 GB GPU can spare.
FSDP2 (configs/fsdp.yaml) and DeepSpeed ZeRO-3 (configs/zero3.yaml) shard that state over the
GPUs (16 B x parameters / GPUs each). `check_replicated_fits` stops a run that cannot fit
before it loads data or starts vLLM, with the config to use instead.
"""

from __future__ import annotations

from parallel_r1.errors import PipelineError

BYTES_PER_PARAMETER = 16  # float32 weight + gradient + AdamW exp_avg + exp_avg_sq
SHARDED_TYPES = ("FSDP", "DEEPSPEED")


def check_replicated_fits(parameters: int, device_bytes: int, reserved_share: float, where: str) -> None:
    """Fail in one line when the fp32 training state of `parameters` exceeds one device's memory
    minus `reserved_share` of it (vLLM's colocated share)."""
    need = BYTES_PER_PARAMETER * parameters
    free = device_bytes * (1.0 - reserved_share)
    if need > free:
        raise PipelineError(f"{where}: replicated training (DDP or one GPU) keeps {need / 2**30:.0f} GiB of "
                            "float32 "
                            f"weights, gradients and AdamW state per GPU, more than the {free / 2**30:.0f} "
                            "GiB it can use; launch with configs/fsdp.yaml or configs/zero3.yaml (sharded)")


def check_training_memory(model, reserved_share: float, where: str) -> None:
    """`check_replicated_fits` for `model` on this process's GPU, unless FSDP / ZeRO-3 shard it (or no
    CUDA)."""
    import torch
    from accelerate import PartialState

    if not torch.cuda.is_available() or PartialState().distributed_type.value in SHARDED_TYPES:
        return
    parameters = sum(p.numel() for p in model.parameters())
    device_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    check_replicated_fits(parameters, device_bytes, reserved_share, where)


LAUNCH_ENV = {"FSDP": "ACCELERATE_USE_FSDP", "DEEPSPEED": "ACCELERATE_USE_DEEPSPEED"}


def check_sharding_active(trainer, where: str) -> None:
    """Fail in one line when the launch asked for FSDP or DeepSpeed but the Trainer trains without it.

    accelerate 1.15 enables FSDP only for GPU-type process groups (and DeepSpeed not with `cpu`):
    `accelerate launch --config_file configs/fsdp.yaml` on a machine without CUDA trains as plain
    data parallel (measured on 2 CPU processes: distributed type MULTI_CPU, `is_fsdp_enabled`
    False), each process holding the whole training state the config was chosen to shard.
    """
    import os

    asked = [kind for kind, env in LAUNCH_ENV.items() if os.environ.get(env, "false").lower() == "true"]
    running = trainer.accelerator.distributed_type.value
    if asked and running not in SHARDED_TYPES:
        raise PipelineError(f"{where}: the launch config asks for {asked[0]}, but accelerate runs {running} "
                            "here (FSDP and ZeRO-3 need GPUs); on a CPU launch with configs/cpu2.yaml")
