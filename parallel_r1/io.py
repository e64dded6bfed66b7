"""JSON / JSONL reading and atomic writing.

Writes go to a temporary file beside the target and are renamed at the end, so a
killed stage never leaves a half-written output for DVC to cache. Reads fail with
one line naming the file and the line that is wrong.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

from parallel_r1.errors import PipelineError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `path`; on success it replaces `path` (file or folder)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if is_dir:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> int:
    """Write rows atomically; returns how many were written."""
    count = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count


def read_json(path: str | os.PathLike) -> Any:
    """A JSON file's value; a missing file, bad UTF-8 or bad JSON is one line naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"{path}: file not found")
    data = path.read_bytes()
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise PipelineError(f"{path}:{line}: not valid UTF-8 (byte {err.start + 1} of the file); "
                            "corrupt file?") from None
    except json.JSONDecodeError as err:
        raise PipelineError(f"{path}:{err.lineno}: not valid JSON ({err.msg}, column {err.colno})") from None


def read_jsonl(path: str | os.PathLike, required: Iterable[str] = (),
               allow_empty: bool = False) -> list[dict]:
    """Rows of a JSONL file; every row must be an object holding the `required` fields."""
    return [row for _, row in read_jsonl_lines(path, required, allow_empty)]


def read_jsonl_lines(path: str | os.PathLike, required: Iterable[str] = (),
                     allow_empty: bool = False) -> list[tuple[int, dict]]:
    """(line number from 1, row) for each row, so later checks can name the line (blank lines skipped)."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"{path}: file not found")
    required = tuple(required)
    rows = []
    with open(path, "rb") as handle:   # bytes: a bad UTF-8 sequence is reported with its line
        for lineno, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise PipelineError(f"{path}:{lineno}: not valid UTF-8 "
                                    f"(byte {err.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise PipelineError(f"{path}:{lineno}: not valid JSON ({err.msg}); truncated file?") from None
            if not isinstance(row, dict):
                raise PipelineError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            missing = [name for name in required if row.get(name) in (None, "")]
            if missing:
                raise PipelineError(f"{path}:{lineno}: missing field(s) {', '.join(missing)}")
            rows.append((lineno, row))
    if not rows and not allow_empty:
        raise PipelineError(f"{path}: empty file (no rows)")
    return rows
