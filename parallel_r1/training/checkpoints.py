"""Resumable training runs shared by SFT and GRPO: run fingerprints and the last checkpoint.

A checkpoint folder holds `run.json`, the fingerprint of what its checkpoints were trained
from (options, data, the starting model's files). Re-running with the same fingerprint
resumes from the last `checkpoint-N`; any other re-run clears the folder and starts afresh,
so a changed param never continues a stale run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from parallel_r1.errors import PipelineError

RUN_RECORD = "run.json"


def trainer_arguments(*, save_steps: int, seed: int, report_to: str | list[str], bf16: bool,
                      gradient_checkpointing: bool) -> dict[str, Any]:
    """The TrainingArguments SFT and GRPO share: a log row per step (the metric files and MLflow
    read them), a checkpoint every `save_steps` with only the last kept (enough to resume), and
    one seed for both the model's sampling and the data order."""
    return dict(gradient_checkpointing=gradient_checkpointing, bf16=bf16, logging_steps=1,
                save_strategy="steps", save_steps=save_steps, save_total_limit=1, seed=seed, data_seed=seed,
                report_to=report_to)


def check_scheduler(name: str, where: str) -> None:
    """Fail in one line on a learning-rate scheduler transformers does not know."""
    from transformers.trainer_utils import SchedulerType

    if name not in {s.value for s in SchedulerType}:
        raise PipelineError(f"{where}: unknown scheduler {name!r} (e.g. constant, cosine, linear)")


def file_signature(folder: Path) -> list:
    """The model folder's identity for a fingerprint: its path and each file's name, size and mtime."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file())
    return [str(folder.resolve()), files]


def as_record(fingerprint: dict[str, Any]) -> dict:
    """The fingerprint as JSON reads it back (tuples become lists), so it compares equal to run.json."""
    return json.loads(json.dumps(fingerprint))


def resume_point(checkpoint_dir: Path, fingerprint: dict, state) -> str | None:
    """The last checkpoint of a run with the same fingerprint; else clear the folder for a fresh run.

    `state` is accelerate's PartialState: every process agrees before the main one clears.
    """
    from transformers.trainer_utils import get_last_checkpoint

    fingerprint = as_record(fingerprint)
    record = checkpoint_dir / RUN_RECORD
    same_run = record.is_file() and json.loads(record.read_text(encoding="utf-8")) == fingerprint
    last = get_last_checkpoint(str(checkpoint_dir)) if same_run else None
    state.wait_for_everyone()
    if not same_run and state.is_main_process:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
        checkpoint_dir.mkdir(parents=True)
        record.write_text(json.dumps(fingerprint), encoding="utf-8")
    state.wait_for_everyone()
    return last
