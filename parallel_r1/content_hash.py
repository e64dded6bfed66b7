"""Content hashes of files and folders as DVC computes them, so MLflow runs can name a model
by the same md5 that dvc.lock records (without importing DVC or copying any weights).

DVC's md5 of a file is the plain md5 of its bytes; of a folder, the md5 of the JSON list of
`{"md5": ..., "relpath": ...}` entries sorted by relpath, with ".dir" appended.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import yaml


def dvc_md5(path: str | os.PathLike) -> str:
    """DVC's md5 of a file, or of a folder (ends in ".dir")."""
    path = Path(path)
    if path.is_file():
        return file_md5(path)
    entries = sorted(({"md5": file_md5(file), "relpath": file.relative_to(path).as_posix()}
                      for file in path.rglob("*") if file.is_file()), key=lambda entry: entry["relpath"])
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode("utf-8")).hexdigest() + ".dir"


def locked_md5(path: str | os.PathLike, root: str | os.PathLike, skip_stage: str | None = None) -> str | None:
    """md5 that `<root>/dvc.lock` records for output `path` of a stage other than `skip_stage`.

    None when there is no dvc.lock, `path` is outside `root`, or no other stage outputs it
    (a running stage's own outputs are only recorded when it ends, so they are skipped).
    """
    root = Path(root).resolve()
    lock_file = root / "dvc.lock"
    if not lock_file.is_file():
        return None
    try:
        relative = Path(path).resolve().relative_to(root).as_posix()
        stages = (yaml.safe_load(lock_file.read_text(encoding="utf-8")) or {}).get("stages") or {}
    except (ValueError, yaml.YAMLError):
        return None
    for name, stage in stages.items():
        if name == skip_stage:
            continue
        for out in stage.get("outs") or []:
            if str(out.get("path", "")).rstrip("/") == relative and out.get("md5"):
                return out["md5"]
    return None


def file_md5(path: str | os.PathLike) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
