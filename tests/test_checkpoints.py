"""Resuming a killed run (SFT and GRPO share `resume_point`): only a complete checkpoint is a resume point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate import PartialState

from parallel_r1.training.checkpoints import RUN_RECORD, is_complete_checkpoint, resume_point

REPO = Path(__file__).resolve().parents[1]
FINGERPRINT = {"options": {"lr": 0.1}, "data_sha256": "abc"}


def fake_checkpoint(folder: Path, step: int, *, weights=True, optimizer=True, state=True) -> Path:
    """A `checkpoint-<step>` folder holding the files the Trainer writes (tiny stand-ins)."""
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    if weights:
        (path / "model.safetensors").write_bytes(b"w")
    if optimizer:
        (path / "optimizer.pt").write_bytes(b"o")
        (path / "scheduler.pt").write_bytes(b"s")
    if state:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


@pytest.fixture
def run_dir(tmp_path) -> Path:
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / RUN_RECORD).write_text(json.dumps(FINGERPRINT))
    return folder


def test_checkpoint_killed_during_its_save_is_skipped_and_removed(run_dir):
    fake_checkpoint(run_dir, 1)
    half = fake_checkpoint(run_dir, 2, optimizer=False, state=False)   # kill -9 while saving step 2
    (half / ".tmp_model.safetensors").write_bytes(b"")
    assert resume_point(run_dir, FINGERPRINT, PartialState()) == str(run_dir / "checkpoint-1")
    assert not half.exists()


def test_first_checkpoint_killed_during_its_save_means_a_fresh_start(run_dir):
    fake_checkpoint(run_dir, 1, weights=False, optimizer=False, state=False)
    assert resume_point(run_dir, FINGERPRINT, PartialState()) is None
    assert not (run_dir / "checkpoint-1").exists() and (run_dir / RUN_RECORD).is_file()


@pytest.mark.parametrize("missing", ["weights", "optimizer", "state"])
def test_a_checkpoint_needs_weights_optimizer_and_trainer_state(tmp_path, missing):
    assert is_complete_checkpoint(fake_checkpoint(tmp_path / "a", 3))
    assert not is_complete_checkpoint(fake_checkpoint(tmp_path / "b", 3, **{missing: False}))


def test_truncated_trainer_state_or_missing_shard_is_incomplete(tmp_path):
    cut = fake_checkpoint(tmp_path / "a", 4)
    (cut / "trainer_state.json").write_text('{"global_step": 4, "log_hi')
    assert not is_complete_checkpoint(cut)
    sharded = fake_checkpoint(tmp_path / "b", 4, weights=False)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    (sharded / "model-00001-of-00002.safetensors").write_bytes(b"w")
    assert not is_complete_checkpoint(sharded)
    (sharded / "model-00002-of-00002.safetensors").write_bytes(b"w")
    assert is_complete_checkpoint(sharded)


def test_truncated_run_record_starts_afresh_instead_of_crashing(run_dir):
    fake_checkpoint(run_dir, 1)
    (run_dir / RUN_RECORD).write_text('{"options": {"lr"')
    assert resume_point(run_dir, FINGERPRINT, PartialState()) is None
    assert json.loads((run_dir / RUN_RECORD).read_text()) == FINGERPRINT


# The child trains a tiny SFT run with a checkpoint every step and SIGKILLs itself at the instant
# the second save has written the weights but not yet the optimizer or trainer state.
KILLED_CHILD = """
import os, signal, sys
from transformers import Trainer
from parallel_r1.data import load_teacher_demos
from parallel_r1.format import check_format
from parallel_r1.models import TinyModelConfig, prepare_base_model
from parallel_r1.training.sft import SFTOptions, train_sft

save_optimizer = Trainer._save_optimizer_and_scheduler
def kill_at_second_save(self, output_dir):
    if self.state.global_step == 2 and os.environ.get("KILL_AT_SAVE") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return save_optimizer(self, output_dir)
Trainer._save_optimizer_and_scheduler = kill_at_second_save

tmp, mirror = sys.argv[1], sys.argv[2]
tiny = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16)
base = tmp + "/base"
if not os.path.isdir(base):
    prepare_base_model("tiny", base, tiny=tiny)
demos = [r for r in load_teacher_demos(mirror, limit=40) if check_format(r["completion"])][:4]
options = SFTOptions(variant="seen", batch_size=2, per_device_batch_size=2, lr=1e-2, weight_decay=0.0,
    warmup_ratio=0.0, lr_scheduler="constant", max_length=288, max_steps=3, attention_backend="dense",
    gradient_checkpointing=False, save_steps=1, probe_questions=1, probe_max_tokens=4)
result = train_sft(options, base, demos, tmp + "/out", tmp + "/checkpoints")
print("RESUMED_FROM", result.resumed_from, "STEPS", [e["step"] for e in result.loss_history])
"""


@pytest.mark.slow
def test_sft_killed_with_sigkill_mid_save_resumes_from_the_previous_checkpoint(tmp_path, mirror):
    env = {**os.environ, "PYTHONPATH": str(REPO), "KILL_AT_SAVE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", KILLED_CHILD, str(tmp_path), str(mirror)]
    killed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    half = tmp_path / "checkpoints" / "checkpoint-2"
    assert (half / "model.safetensors").is_file() and not (half / "trainer_state.json").exists()

    resumed = subprocess.run(command, env={**env, "KILL_AT_SAVE": "0"}, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    checkpoint_1 = tmp_path / "checkpoints" / "checkpoint-1"
    assert f"RESUMED_FROM {checkpoint_1} STEPS [1, 2, 3]" in resumed.stdout
    assert (tmp_path / "out" / "model.safetensors").is_file()
