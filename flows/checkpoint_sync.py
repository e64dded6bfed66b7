"""A running experiment's training checkpoints, kept on the DVC remote so that a retry elsewhere resumes.

A worker that dies takes its private clone with it, and with it `checkpoints/` (SFT's `sft_<variant>`,
GRPO's `rl/<run>`: git- and DVC-ignored working folders, each holding `run.json`, the fingerprint of its
run, and `checkpoint-N` folders). While `dvc exp run` trains, the experiment flow copies the newest
complete checkpoint of each such folder to the project's DVC remote; a retry copies them back into its
own clone before `dvc exp run`, and the training code resumes from them as it does on one machine
(`training.checkpoints.resume_point`: same fingerprint, which names the starting model by content).

On the remote (reached through DVC's own filesystem for the clone's default remote, so a path, s3://,
gs://, azure:// all work), under `<remote>/checkpoints/<sweep id>/<experiment>/<folder>/`:

    checkpoint-N/...        the checkpoint's files, as the Trainer wrote them
    checkpoint-N.json       its commit marker, written last: run.json's fingerprint and every file's size

Only a checkpoint with its marker is pulled, so one half copied when the worker died is never used;
the marker is one PUT (a rename on a filesystem). Only complete checkpoints are pushed
(`is_complete_checkpoint`), and only the newest is kept, as the Trainer keeps one (save_total_limit 1):
after a new marker is written, the older checkpoints and any unmarked leftovers go (markers first).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from parallel_r1.training.checkpoints import RUN_RECORD, is_complete_checkpoint, last_complete_checkpoint

CHECKPOINTS = "checkpoints"   # the stages' checkpoint root (relative to a clone) and the remote prefix
MARKER = re.compile(r"^(checkpoint-\d+)\.json$")
PUSH_EVERY_S = 10.0


@dataclass
class CheckpointStore:
    """The checkpoints of one experiment on the DVC remote: `fs` (DVC's filesystem) under `prefix`."""

    fs: Any
    prefix: str

    @classmethod
    def for_experiment(cls, root: Path, sweep_id: str, name: str) -> CheckpointStore:
        """The store of experiment `name` of `sweep_id`, on the default DVC remote of the clone at `root`."""
        from dvc.repo import Repo

        with Repo(os.fspath(root)) as repo:
            remote = repo.cloud.get_remote()
        return cls(remote.fs, remote.fs.join(remote.path, CHECKPOINTS, sweep_id, name))

    def url(self) -> str:
        return self.fs.unstrip_protocol(self.prefix)

    def committed(self) -> dict[str, dict[str, dict]]:
        """{folder: {checkpoint name: its marker}} of every checkpoint whose marker is on the remote."""
        found: dict[str, dict[str, dict]] = {}
        for path in self._files():
            *folder, leaf = self.fs.relparts(path, self.prefix)
            match = MARKER.match(leaf)
            if match and folder and not _inside_checkpoint(folder):
                marker = json.loads(self.fs.cat_file(path))
                found.setdefault("/".join(folder), {})[match.group(1)] = marker
        return found

    def push(self, root: Path) -> list[str]:
        """Copy the newest complete checkpoint of each folder under `root`/checkpoints that the remote
        lacks; returns the ones pushed (`<folder>/checkpoint-N`). A checkpoint the Trainer removes or
        rewrites while it is copied is left unmarked (and removed by a later push)."""
        pushed = []
        committed = self.committed()
        for local in _checkpoint_folders(root):
            folder = local.relative_to(root / CHECKPOINTS).as_posix()
            newest, _ = last_complete_checkpoint(local)
            if newest is None or newest.name in committed.get(folder, {}):
                continue
            if self._push_one(local, folder, newest):
                pushed.append(f"{folder}/{newest.name}")
                self._prune(folder, keep=newest.name)
        return pushed

    def pull(self, root: Path) -> list[str]:
        """Copy the newest committed checkpoint of each folder (with its run.json) into `root`/checkpoints,
        replacing what is there; returns them (`<folder>/checkpoint-N`), empty when the remote has none."""
        restored = []
        for folder, markers in sorted(self.committed().items()):
            name = max(markers, key=lambda checkpoint: int(checkpoint.rsplit("-", 1)[1]))
            marker = markers[name]
            local = root / CHECKPOINTS / folder
            shutil.rmtree(local, ignore_errors=True)
            partial = local / f".{name}.pulling"
            for relpath, size in marker["files"].items():
                target = partial / relpath
                target.parent.mkdir(parents=True, exist_ok=True)
                source = self.fs.join(self.prefix, folder, name, *relpath.split("/"))
                self.fs.get_file(source, os.fspath(target))
                if target.stat().st_size != size:
                    raise OSError(f"{self.url()}/{folder}/{name}/{relpath}: {target.stat().st_size} bytes "
                                  f"copied, the marker says {size}")
            partial.rename(local / name)
            (local / RUN_RECORD).write_text(json.dumps(marker["run"]), encoding="utf-8")
            restored.append(f"{folder}/{name}")
        return restored

    def remove(self) -> None:
        """Delete every checkpoint of the experiment from the remote (after its results are pushed)."""
        if self.fs.exists(self.prefix):
            self.fs.rm(self.prefix, recursive=True)

    def _files(self) -> list[str]:
        if not self.fs.exists(self.prefix):
            return []
        return list(self.fs.find(self.prefix))

    def _push_one(self, local: Path, folder: str, checkpoint: Path) -> bool:
        try:
            run = json.loads((local / RUN_RECORD).read_text(encoding="utf-8"))
            files = _file_sizes(checkpoint)
            for relpath in files:
                self.fs.put_file(os.fspath(checkpoint / relpath),
                                 self.fs.join(self.prefix, folder, checkpoint.name, *relpath.split("/")))
            unchanged = _file_sizes(checkpoint) == files
        except (OSError, ValueError):  # removed (rotation, a fresh start) or rewritten while copied
            return False
        if not unchanged or not is_complete_checkpoint(checkpoint):
            return False
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as handle:
            json.dump({"run": run, "files": files}, handle)
        try:
            self.fs.put_file(handle.name, self.fs.join(self.prefix, folder, f"{checkpoint.name}.json"))
        finally:
            os.unlink(handle.name)
        return True

    def _prune(self, folder: str, keep: str) -> None:
        """Remove the folder's other checkpoints from the remote: their markers first, then their files."""
        base = self.fs.join(self.prefix, folder)
        entries = [self.fs.name(path.rstrip("/")) for path in self.fs.ls(base)]
        for entry in entries:
            match = MARKER.match(entry)
            if match and match.group(1) != keep:
                self.fs.rm_file(self.fs.join(base, entry))
        for entry in entries:
            if entry.startswith("checkpoint-") and not entry.endswith(".json") and entry != keep:
                self.fs.rm(self.fs.join(base, entry), recursive=True)


def _file_sizes(checkpoint: Path) -> dict[str, int]:
    """{relative path: size} of every file of `checkpoint`: the marker's manifest, and how a push sees
    whether the Trainer rewrote the checkpoint while it was copied."""
    return {path.relative_to(checkpoint).as_posix(): path.stat().st_size
            for path in sorted(checkpoint.rglob("*")) if path.is_file()}


def _checkpoint_folders(root: Path) -> list[Path]:
    """The folders under root/checkpoints the training code resumes from: those holding a run.json."""
    top = root / CHECKPOINTS
    return sorted(record.parent for record in top.rglob(RUN_RECORD)) if top.is_dir() else []


def _inside_checkpoint(parts: list[str]) -> bool:
    return any(part.startswith("checkpoint-") for part in parts)


class PushingInBackground:
    """A thread that pushes `root`'s complete checkpoints to `store` every `every_s` seconds until
    stopped (a context manager). A failed push is reported through `echo` and tried again next time:
    the experiment itself never fails for it."""

    def __init__(self, store: CheckpointStore, root: Path, echo: Callable[[str], Any],
                 every_s: float = PUSH_EVERY_S):
        self.store, self.root, self.echo, self.every_s = store, root, echo, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoint-push", daemon=True)

    def __enter__(self) -> PushingInBackground:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                for checkpoint in self.store.push(self.root):
                    self.echo(f"checkpoint {checkpoint} pushed to {self.store.url()}")
            except Exception as err:  # noqa: BLE001 -- a remote hiccup must not end the experiment
                self.echo(f"checkpoint push to {self.store.url()} failed, will retry: {err}")
