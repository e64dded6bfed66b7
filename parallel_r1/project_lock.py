"""One pipeline invocation at a time per project: `make run`, flows.reproduce and a profile switch hold it.

    with project_lock(root):   # flows.reproduce's main (before Prefect starts) and @holds_project_lock
        ...

DVC's own repo lock is not enough: `dvc repro` releases it while a stage command runs, so a second
`dvc repro` started meanwhile runs other stages and rewrites dvc.lock next to the first. The entry
points (flows.reproduce, which `make run` is, and stages.profiles) take this lock for their whole run; a
second one is refused in one line naming the holder. It is an flock on .dvc/tmp/pipeline.lock: the kernel
drops it when the holder dies (kill -9 included), so a stale lock never blocks a later run. Nested
takes in one process (a flow switching the profile) are no-ops. A sweep (flows.sweep) does not take it: each
of its experiments is a `dvc exp run --temp` in a temporary clone (or a worker's clone), which never writes
the workspace's outputs or dvc.lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from parallel_r1.errors import PipelineError

LOCK_FILE = Path(".dvc") / "tmp" / "pipeline.lock"
_HELD: set[Path] = set()   # lock files this process holds
F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def project_lock(root: str | os.PathLike = ".") -> Iterator[Path]:
    """Hold the project's pipeline lock for the block; `PipelineError` when another process holds it."""
    path = (Path(root) / LOCK_FILE).resolve()
    if path in _HELD:
        yield path
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "a process that has not written its name yet"
            raise PipelineError(f"{Path(root) / LOCK_FILE}: another pipeline run holds the project lock "
                                f"({holder}); wait for it to end or stop it") from None
        handle.seek(0)
        handle.truncate()
        argv = list(getattr(sys, "orig_argv", sys.argv)) or ["python"]
        command = " ".join(shlex.join([Path(argv[0]).name, *argv[1:]]).split())   # one line, for the error
        command = command if len(command) <= 120 else command[:117] + "..."
        handle.write(f"pid {os.getpid()}: {command}, since {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
        handle.flush()
        _HELD.add(path)
        try:
            yield path
        finally:
            _HELD.discard(path)
            handle.seek(0)
            handle.truncate()
            fcntl.flock(handle, fcntl.LOCK_UN)


def holds_project_lock(func: F) -> F:
    """Run `func` holding the lock of the project in the cwd (for a Prefect flow: its signature is kept)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with project_lock(Path.cwd()):
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
