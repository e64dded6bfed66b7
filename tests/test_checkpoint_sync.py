"""A killed experiment's checkpoints on the DVC remote (flows/checkpoint_sync.py) and the model identity that
lets another clone resume from them (identity.file_signature)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from accelerate import PartialState

from flows.checkpoint_sync import CheckpointStore
from parallel_r1.identity import file_signature, work_identity
from parallel_r1.training.checkpoints import RUN_RECORD, resume_point
from tests.test_checkpoints import fake_checkpoint

FINGERPRINT = {"options": {"lr": 0.1}, "data_sha256": "abc"}


@pytest.fixture
def store(tmp_path) -> CheckpointStore:
    """The store of one experiment on the filesystem remote of a fresh DVC project."""
    from dvc.repo import Repo

    root = tmp_path / "project"
    root.mkdir()
    with Repo.init(os.fspath(root), no_scm=True) as repo, repo.config.edit() as config:
        config["remote"]["storage"] = {"url": os.fspath(tmp_path / "remote")}
        config["core"]["remote"] = "storage"
    return CheckpointStore.for_experiment(root, "sweep-1", "sweep-1-2")


def run_folder(root: Path, name: str = "sft_seen") -> Path:
    folder = root / "checkpoints" / name
    folder.mkdir(parents=True)
    (folder / RUN_RECORD).write_text(json.dumps(FINGERPRINT))
    return folder


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_only_the_newest_complete_checkpoint_is_pushed_and_a_pull_elsewhere_restores_it(store, tmp_path):
    folder = run_folder(tmp_path / "worker-a")
    fake_checkpoint(folder, 1)
    (fake_checkpoint(folder, 2) / "model.safetensors").write_bytes(os.urandom(4096))
    fake_checkpoint(folder, 3, optimizer=False, state=False)  # killed during its save
    fake_checkpoint(run_folder(tmp_path / "worker-a", "rl/run_a"), 4)
    assert store.push(tmp_path / "worker-a") == ["rl/run_a/checkpoint-4", "sft_seen/checkpoint-2"]
    remote = tmp_path / "remote" / "checkpoints" / "sweep-1" / "sweep-1-2"
    assert sorted(p.name for p in (remote / "sft_seen").iterdir()) == ["checkpoint-2", "checkpoint-2.json"]
    assert store.push(tmp_path / "worker-a") == []  # nothing new

    assert store.pull(tmp_path / "worker-b") == ["rl/run_a/checkpoint-4", "sft_seen/checkpoint-2"]
    pulled = tmp_path / "worker-b" / "checkpoints" / "sft_seen"
    assert files_of(pulled / "checkpoint-2") == files_of(folder / "checkpoint-2")  # byte for byte
    assert json.loads((pulled / RUN_RECORD).read_text()) == FINGERPRINT
    assert sorted(p.name for p in pulled.iterdir()) == ["checkpoint-2", RUN_RECORD]
    assert resume_point(pulled, FINGERPRINT, PartialState()) == str(pulled / "checkpoint-2")


def test_a_copy_cut_short_is_never_pulled_and_a_newer_push_replaces_it_and_the_older_one(store, tmp_path):
    folder = run_folder(tmp_path / "worker-a")
    fake_checkpoint(folder, 2)
    store.push(tmp_path / "worker-a")
    remote = tmp_path / "remote" / "checkpoints" / "sweep-1" / "sweep-1-2" / "sft_seen"
    shutil.copytree(folder / "checkpoint-2", remote / "checkpoint-3")  # the worker died before the marker
    assert store.pull(tmp_path / "worker-b") == ["sft_seen/checkpoint-2"]
    assert not (tmp_path / "worker-b" / "checkpoints" / "sft_seen" / "checkpoint-3").exists()

    shutil.rmtree(folder / "checkpoint-2")  # the Trainer's rotation
    fake_checkpoint(folder, 4)
    assert store.push(tmp_path / "worker-a") == ["sft_seen/checkpoint-4"]
    assert sorted(p.name for p in remote.iterdir()) == ["checkpoint-4", "checkpoint-4.json"]


def test_pull_replaces_what_the_clone_had_and_remove_leaves_nothing(store, tmp_path):
    fake_checkpoint(run_folder(tmp_path / "worker-a"), 5)
    store.push(tmp_path / "worker-a")
    stale = run_folder(tmp_path / "worker-b")
    fake_checkpoint(stale, 1)
    (stale / RUN_RECORD).write_text(json.dumps({"another": "run"}))
    store.pull(tmp_path / "worker-b")
    assert sorted(p.name for p in stale.iterdir()) == ["checkpoint-5", RUN_RECORD]
    assert json.loads((stale / RUN_RECORD).read_text()) == FINGERPRINT
    store.remove()
    assert not (tmp_path / "remote" / "checkpoints" / "sweep-1" / "sweep-1-2").exists()
    assert store.pull(tmp_path / "worker-c") == [] and store.committed() == {}
    store.remove()  # nothing there: no error


def test_a_remote_file_of_the_wrong_size_fails_the_pull_in_one_line(store, tmp_path):
    fake_checkpoint(run_folder(tmp_path / "worker-a"), 1)
    store.push(tmp_path / "worker-a")
    weights = tmp_path / "remote/checkpoints/sweep-1/sweep-1-2/sft_seen/checkpoint-1/model.safetensors"
    weights.write_bytes(b"truncated?")
    with pytest.raises(OSError, match=r"checkpoint-1/model.safetensors: 10 bytes copied, the marker says"):
        store.pull(tmp_path / "worker-b")


def test_the_model_identity_is_its_content_not_its_path_or_mtimes(tmp_path):
    one = tmp_path / "clone-a" / "models" / "base"
    one.mkdir(parents=True)
    (one / "model.safetensors").write_bytes(os.urandom(1000))
    (one / "config.json").write_text('{"hidden_size": 8}')
    other = tmp_path / "clone-b" / "models" / "base"
    shutil.copytree(one, other, copy_function=shutil.copy)  # new mtimes, another path
    os.utime(other / "config.json", ns=(1, 1))
    assert file_signature(one) == file_signature(other)
    assert work_identity(one, {"lr": 1}) == work_identity(other, {"lr": 1})
    weights = bytearray((other / "model.safetensors").read_bytes())
    weights[500] ^= 1  # one bit
    (other / "model.safetensors").write_bytes(bytes(weights))
    assert file_signature(one) != file_signature(other)
