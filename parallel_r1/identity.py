"""What a piece of resumable work is: the one definition behind every resume decision.

SFT and GRPO checkpoints (`training/checkpoints.py`, run.json) and the evaluation's partial samples
(`generation.py`, each row's stamp) are resumed only by work with the same identity: the starting
model's files, the settings that decide the result, and the data. Two other identities exist on
purpose and are not this one: DVC's hashes (whether a stage must run at all) and the memo keys
(`sample_memo`, `training/run_memo.py`), which compare weights by value so that different runs with
equal weights share results; an identity here is about one run continuing itself.

The model is named by its files' content (names, sizes, sha256), not by where it lies or when it was
written: a run killed on one worker is resumed by a retry in another private clone, on another machine
(flows/checkpoint_sync.py brings its checkpoints there), where the same model was pulled from the DVC
remote at another path with other mtimes. Hashing reads the starting model once per run: one
sequential read, beside the training it guards.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping


def file_signature(folder: Path) -> list:
    """The model folder's identity by content: each file's name, size and sha256 (sub-folders, such as a
    scaffold run's step snapshots, are not the model and are not read)."""
    files = []
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        with open(path, "rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
        files.append([path.name, path.stat().st_size, digest])
    return files


def work_identity(model_dir: Path, settings: Mapping[str, Any], data_sha256: str | None = None) -> dict:
    """The identity of work that starts from the model in `model_dir`, decided by `settings` (JSON-able:
    options, rewards, sampling config) over data with digest `data_sha256`; as JSON reads it back, so it
    compares equal to a stored copy."""
    identity = {"model": file_signature(model_dir), "settings": dict(settings), "data_sha256": data_sha256}
    return json.loads(json.dumps(identity))


def identity_stamp(identity: Mapping[str, Any]) -> str:
    """A short digest of `identity`, for rows that carry it (the partial samples)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
