"""JSON / JSONL reading and atomic writing.

Writes go to a temporary file beside the target and are renamed at the end, so a
killed stage never leaves a half-written output for DVC to cache; `publish_together` renames
several outputs only once all of them are written. Reads fail with
one line naming the file and the line that is wrong.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

from parallel_r1.errors import PipelineError


class Publication:
    """Outputs written to temporary siblings, then renamed into place together.

    A stage that writes several outputs (the filter: metrics per dataset and the SFT set) either
    publishes all of them or none: every file is complete on disk before the first rename, and a
    write error, a bad row or Ctrl-C before that leaves every previous output as it was. A write
    error is one line naming the output (`PipelineError`), not an OSError from deep inside.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Path, Path]] = []   # (temporary, target), in the order asked for

    def path(self, target: str | os.PathLike, is_dir: bool = False) -> Path:
        """A new temporary sibling of `target` (a file, or a folder when `is_dir`) to write into."""
        target = Path(target)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if is_dir:
                tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
            else:
                fd, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
                os.close(fd)
                tmp = Path(name)
            # mkstemp/mkdtemp make 0600/0700, and the mode survives the rename: published outputs get the
            # mode any new file gets here (0644/0755 under the usual umask 022).
            tmp.chmod((0o777 if is_dir else 0o666) & ~current_umask())
        except OSError as err:
            raise write_error(target, err) from None
        self._pending.append((tmp, target))
        return tmp

    def write_json(self, target: str | os.PathLike, obj: Any) -> None:
        tmp = self.path(target)
        try:
            tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        except OSError as err:
            raise write_error(target, err) from None

    def write_jsonl(self, target: str | os.PathLike, rows: Iterable[dict]) -> int:
        """Write rows; returns how many were written."""
        tmp = self.path(target)
        count = 0
        try:
            with open(tmp, "w", encoding="utf-8") as handle:
                for row in rows:
                    handle.write(json.dumps(row, ensure_ascii=False) + "\n")
                    count += 1
        except OSError as err:
            raise write_error(target, err) from None
        return count

    def commit(self) -> None:
        """Rename every temporary onto its target (a folder target is replaced whole), each file and folder
        in it with the mode a new one gets here (`publish_modes`)."""
        for tmp, target in self._pending:
            try:
                publish_modes(tmp)
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                os.replace(tmp, target)
            except OSError as err:
                raise write_error(target, err) from None
        self._pending.clear()

    def discard(self) -> None:
        """Remove the temporaries not renamed (after an error): no half-written file is left behind."""
        for tmp, _ in self._pending:
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
        self._pending.clear()


def publish_modes(path: Path) -> None:
    """Give `path` and everything under it the mode a new file or folder gets under the umask (0644/0755
    under 022), keeping execute bits: libraries write through their own temporaries (transformers saves
    model.safetensors as 0600), and a file's mode must not depend on who wrote it (DVC restores 0644)."""
    mask = current_umask()
    for item in (path, *path.rglob("*")) if path.is_dir() else (path,):
        if item.is_symlink():
            continue
        executable = item.is_dir() or item.stat().st_mode & 0o111
        item.chmod((0o777 if executable else 0o666) & ~mask)


@contextlib.contextmanager
def publish_together() -> Iterator[Publication]:
    """A `Publication` whose outputs are renamed into place when the block ends without error."""
    publication = Publication()
    try:
        yield publication
        publication.commit()
    finally:
        publication.discard()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `path`; on success it replaces `path` (file or folder).

    An OSError of the block on the temporary itself (disk full, file too large) becomes one line
    naming `path`; other errors go on untouched.
    """
    with publish_together() as publication:
        tmp = publication.path(path, is_dir)
        try:
            yield tmp
        except OSError as err:
            if err.filename is None or str(err.filename).startswith(str(tmp)):
                raise write_error(path, err) from None
            raise


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with publish_together() as publication:
        publication.write_json(path, obj)


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> int:
    """Write rows atomically; returns how many were written."""
    with publish_together() as publication:
        return publication.write_jsonl(path, rows)


def write_error(target: str | os.PathLike, err: OSError) -> PipelineError:
    """One line for a failed write: the output, and the system's reason (errno name)."""
    name = errno.errorcode.get(err.errno or 0, "")
    return PipelineError(f"{target}: cannot write ({err.strerror or err}{f', {name}' if name else ''})")


def current_umask() -> int:
    """The process umask (Linux reports it in /proc; elsewhere it is read by setting it and back)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def json_problem(err: json.JSONDecodeError) -> str:
    """What the decoder found and where on the line: json's own messages end mid-sentence ("Invalid control
    character at") because the position is formatted after them."""
    return f"{err.msg.removesuffix(' at')} at column {err.colno}"


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
        raise PipelineError(f"{path}:{err.lineno}: not valid JSON ({json_problem(err)})") from None


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
                raise PipelineError(f"{path}:{lineno}: not valid JSON ({json_problem(err)}); truncated "
                                    "file?") from None
            if not isinstance(row, dict):
                raise PipelineError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            missing = [name for name in required if row.get(name) in (None, "")]
            if missing:
                raise PipelineError(f"{path}:{lineno}: missing field(s) {', '.join(missing)}")
            rows.append((lineno, row))
    if not rows and not allow_empty:
        raise PipelineError(f"{path}: empty file (no rows)")
    return rows
