"""Resumable training runs shared by SFT and GRPO: run fingerprints and the last complete checkpoint.

A checkpoint folder holds `run.json`, the fingerprint of what its checkpoints were trained from
(`identity.work_identity`: options, data, the starting model's files). Re-running with the same
fingerprint resumes from the newest *complete* `checkpoint-N`; any other re-run clears the folder and
starts afresh, so a changed param never continues a stale run.

Why "complete": the Trainer writes `checkpoint-N` in place (weights, optimizer, scheduler,
RNG states, `trainer_state.json` last) and only then deletes the older one. A `kill -9`
during a save (minutes at paper scale) leaves a newest folder without its trainer state,
and one during the rotation leaves an older folder half deleted; resuming from either
crashes the Trainer. Both are skipped (and removed), and the newest whole one is used.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from parallel_r1.errors import PipelineError
from parallel_r1.io import write_json

RUN_RECORD = "run.json"
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")   # transformers' PREFIX_CHECKPOINT_DIR folders
TRAINER_STATE = "trainer_state.json"                 # written last by Trainer._save_checkpoint
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")
OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")
# Sharded saves: FSDP writes pytorch_model_fsdp_*/ and optimizer_*/ folders, DeepSpeed global_step*/
# (which also holds the weights under ZeRO-3, when no model file is written).
SHARDED_WEIGHT_DIRS = ("pytorch_model_fsdp", "global_step")
SHARDED_OPTIMIZER_DIRS = ("optimizer", "global_step")


def trainer_arguments(*, save_steps: int, seed: int, report_to: str | list[str], bf16: bool,
                      gradient_checkpointing: bool) -> dict[str, Any]:
    """The TrainingArguments SFT and GRPO share: a log row per step (the metric files and MLflow
    read them), a checkpoint every `save_steps` with only the last kept (enough to resume), and
    one seed for both the model's sampling and the data order. Without a GPU, `use_cpu`: transformers
    refuses bf16 otherwise (accelerate then autocasts on the CPU), and only with it does a
    multi-process launch become a gloo process group (`process_state`)."""
    import torch

    return dict(gradient_checkpointing=gradient_checkpointing, bf16=bf16,
                use_cpu=not torch.cuda.is_available(), logging_steps=1,
                save_strategy="steps", save_steps=save_steps, save_total_limit=1, seed=seed, data_seed=seed,
                report_to=report_to)


def no_checkpoint_at_the_end():
    """A TrainerCallback that drops the checkpoint of a run's last step.

    transformers saves one when training ends; SFT and GRPO write their final model right after it and
    then delete the checkpoint folder, so that checkpoint (weights plus optimizer state: 1.6 GB for
    SmolLM2-135M, for each of the default profile's 16 training stages, 2 SFT and 14 RL) would be written
    only to be removed. A run killed while its final model is written resumes from the checkpoint before.
    Listed after the Trainer's own DefaultFlowCallback, which asked for the save in the same event.
    """
    from transformers import TrainerCallback

    class NoCheckpointAtTheEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= state.max_steps:
                control.should_save = False
            return control

    return NoCheckpointAtTheEnd()


def process_state():
    """accelerate's PartialState, set up as the Trainer will set it up (`use_cpu` without a GPU).

    On a machine without CUDA, accelerate joins the processes of a launch (RANK / WORLD_SIZE set)
    into a gloo group only when asked for the CPU; a bare `PartialState()` would make every process
    of `accelerate launch --config_file configs/cpu2.yaml` believe it is alone, size its batch for
    one process and write the outputs itself.
    """
    import torch
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def check_scheduler(name: str) -> None:
    """Fail in one line on a learning-rate scheduler transformers does not know (options' field check)."""
    from transformers.trainer_utils import SchedulerType

    if name not in {s.value for s in SchedulerType}:
        raise PipelineError(f"lr_scheduler: unknown scheduler {name!r} (e.g. constant, cosine, linear)")


def _has_dir(folder: Path, prefixes: tuple[str, ...]) -> bool:
    return any(p.is_dir() and p.name.startswith(prefixes) for p in folder.iterdir())


def _has_weights(folder: Path) -> bool:
    """Weights are there: a weights file (every shard of an index) or a sharded-save folder."""
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if not name.endswith(".index.json"):
            return True
        try:
            shards = set(json.loads(path.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            return False
        return all((folder / shard).is_file() for shard in shards)
    return _has_dir(folder, SHARDED_WEIGHT_DIRS)


def is_complete_checkpoint(folder: Path) -> bool:
    """Whether `folder` holds weights, optimizer state and a readable trainer state of its own step."""
    match = CHECKPOINT_NAME.match(folder.name)
    if match is None or not folder.is_dir():
        return False
    try:
        step = json.loads((folder / TRAINER_STATE).read_text(encoding="utf-8")).get("global_step")
    except (OSError, ValueError, AttributeError):
        return False
    has_optimizer = (any((folder / name).is_file() for name in OPTIMIZER_FILES)
                     or any(folder.glob(f"rank*-of-*-{OPTIMIZER_FILES[0]}"))
                     or _has_dir(folder, SHARDED_OPTIMIZER_DIRS))
    return step == int(match.group(1)) and has_optimizer and _has_weights(folder)


def last_complete_checkpoint(checkpoint_dir: Path) -> tuple[Path | None, list[Path]]:
    """(newest complete checkpoint or None, the incomplete `checkpoint-N` folders beside it)."""
    if not checkpoint_dir.is_dir():
        return None, []
    numbered = [(int(match.group(1)), p) for p in checkpoint_dir.iterdir()
                if p.is_dir() and (match := CHECKPOINT_NAME.match(p.name))]
    found = [p for _, p in sorted(numbered, key=lambda step_path: step_path[0])]
    complete = [p for p in found if is_complete_checkpoint(p)]
    return (complete[-1] if complete else None), [p for p in found if p not in complete]


def checkpoint_step(checkpoint: str | None) -> int:
    """The step a resumed run starts after: N of `.../checkpoint-N`, 0 for a fresh start (None)."""
    return int(Path(checkpoint).name.rsplit("-", 1)[1]) if checkpoint else 0


def _read_record(record: Path) -> Any:
    """run.json's fingerprint; None when missing or unreadable (then the run starts afresh)."""
    try:
        return json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def resume_point(checkpoint_dir: Path, fingerprint: dict, state) -> str | None:
    """The newest complete checkpoint of a run with the same fingerprint; else clear the folder.

    Incomplete checkpoints (a save or a rotation cut short) are removed, so the Trainer never
    resumes from one nor saves the same step into a folder holding stale files. `state` is
    accelerate's PartialState: every process agrees before the main one changes anything.
    """
    fingerprint = json.loads(json.dumps(fingerprint))  # as run.json reads back (tuples become lists)
    record = checkpoint_dir / RUN_RECORD
    same_run = _read_record(record) == fingerprint
    last, incomplete = last_complete_checkpoint(checkpoint_dir) if same_run else (None, [])
    state.wait_for_everyone()
    if state.is_main_process:
        if not same_run:
            shutil.rmtree(checkpoint_dir, ignore_errors=True)
            checkpoint_dir.mkdir(parents=True)
            write_json(record, fingerprint)
        for folder in incomplete:
            print(f"{folder}: incomplete checkpoint (killed during a save?), removed")
            shutil.rmtree(folder, ignore_errors=True)
    state.wait_for_everyone()
    return str(last) if last is not None else None
