"""Save a trained policy as one loadable safetensors model, whatever the accelerate config shards.

transformers' `Trainer.save_model` writes no weights under FSDP with a sharded state dict
(configs/fsdp.yaml keeps SHARDED_STATE_DICT so that resume checkpoints stay fast and small):
it only saves when the plugin's type is FULL_STATE_DICT. `save_full_model` gathers the full
state dict itself in that case (accelerate's `get_state_dict`: FSDP2's
`get_model_state_dict(full_state_dict=True, cpu_offload=True)`, every process joins) and lets the
main process write it; DDP, DeepSpeed ZeRO-3 (`zero3_save_16bit_model: true`) and one process
go through `save_model` as before.
"""

from __future__ import annotations

from pathlib import Path


def sharded_fsdp(trainer) -> bool:
    """Whether the trainer runs under FSDP with a state dict type other than FULL_STATE_DICT."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return False
    return "FULL_STATE_DICT" not in str(trainer.accelerator.state.fsdp_plugin.state_dict_type)


def save_full_model(trainer, folder: str | Path) -> None:
    """Weights (safetensors), config and tokenizer in `folder`; call on every process."""
    if not sharded_fsdp(trainer):
        trainer.save_model(str(folder))
        return
    state_dict = trainer.accelerator.get_state_dict(trainer.model)  # a collective: every rank gathers
    if trainer.args.should_save:
        trainer._save(str(folder), state_dict=state_dict)
    trainer.accelerator.wait_for_everyone()
