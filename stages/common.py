"""Plumbing shared by the stage CLIs: params.yaml, and one-line failures.

params.yaml holds the active profile's values, composed from conf/ (stages/profiles.py); a stage reads
it as it is, the same values DVC tracks.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
import signal
import sys
import threading
from itertools import dropwhile
from pathlib import Path
from typing import Any, Callable

import yaml

from parallel_r1.errors import PipelineError
from parallel_r1.tracking import is_main_process  # one definition: the rank that logs and tracks

PARAMS_FILE = Path("params.yaml")
# The profiles this code composes (stages/profiles.py); every stage refuses a params.yaml naming another, so
# a bare `dvc repro` cannot record a profile that does not exist in dvc.lock
PROFILE_DIR = Path(__file__).resolve().parents[1] / "conf" / "profile"
log = logging.getLogger("stages")  # every stage's progress lines; set up once by `stage_main`


def load_params(path: str | os.PathLike = PARAMS_FILE) -> dict[str, Any]:
    """params.yaml as the stages read it: the active profile's values, a relative mirror anchored at the
    project root."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"{path}: file not found (run from the project root)")
    params = read_params_yaml(path)
    if not isinstance(params.get("profile"), str):
        raise PipelineError(f"{path}: no `profile` name (compose it: python -m stages.profiles <profile>)")
    known = sorted(found.stem for found in PROFILE_DIR.glob("*.yaml"))
    if params["profile"] not in known:
        raise PipelineError(f"{path} profile: {params['profile']!r} is not a profile of conf/profile/ "
                            f"(choose from {', '.join(known)}: python -m stages.profiles <profile>)")
    _anchor_mirror(params)
    return params


def _anchor_mirror(params: dict[str, Any]) -> None:
    """Resolve a relative `data.mirror_dir` against the project root, not the stage's cwd.

    `dvc exp run --temp` runs stages in a copy under .dvc/tmp/exps/, where `../shared/data`
    would point nowhere; DVC passes the project root in env DVC_ROOT.
    """
    data = params.get("data")
    mirror = data.get("mirror_dir") if isinstance(data, dict) else None
    if mirror and not os.path.isabs(mirror):
        assert isinstance(data, dict)  # mirror is set only when it is
        root = Path(os.environ.get("DVC_ROOT") or ".")
        data["mirror_dir"] = str((root / mirror).resolve())
        link_mirror_for_temp_experiments(root, mirror)


def link_mirror_for_temp_experiments(root: Path, mirror: str) -> None:
    """Make a relative mirror resolve inside `dvc exp run --temp` workspaces too.

    dvc.yaml names the mirror files as deps through `${data.mirror_dir}`, and DVC resolves them
    from the stage's folder: DVC 3.67 runs a --temp experiment in
    <root>/.dvc/tmp/exps/standalone/<tmp>/, where `../shared/data` means
    .dvc/tmp/exps/standalone/shared/data. A symlink there to the real folder keeps the dep paths,
    and so dvc.lock, the same as in the workspace (an absolute path would differ and rerun stages).
    Made by every stage run and by the sweep flow (both read params here); a no-op elsewhere.
    """
    parts = Path(mirror).parts
    ups = len(parts) - len(tuple(dropwhile(lambda part: part == "..", parts)))
    experiments = root / ".dvc" / "tmp" / "exps" / "standalone"
    if not (root / ".dvc").is_dir() or ups == 0 or ups > 4 or ups == len(parts):
        return
    link = (experiments / "tmp").parents[ups - 1] / parts[ups]
    target = (root / Path(*parts[:ups + 1])).resolve()
    try:
        if link.is_symlink() and Path(os.readlink(link)) == target:
            return
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink():
            link.unlink()
        if not link.exists():
            link.symlink_to(target, target_is_directory=True)
    except OSError as err:   # never fail a stage over this; a --temp experiment would then say why
        log.warning(f"warning: cannot link {link} -> {target} for dvc exp run --temp ({err})")


def read_params_yaml(path: Path) -> dict[str, Any]:
    """params.yaml as a mapping; a YAML syntax error is one line with the file, line and column."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise PipelineError(f"{path}: not valid UTF-8 (byte {err.start})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise PipelineError(f"{where}: YAML syntax error ({problem})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise PipelineError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    return raw


def section(params: dict[str, Any], *keys: str) -> Any:
    """`params[k1][k2]...`, failing with the dotted name when a key is missing."""
    node: Any = params
    for depth, key in enumerate(keys):
        if not isinstance(node, dict) or key not in node:
            raise PipelineError(f"params.yaml: missing key {'.'.join(keys[: depth + 1])}")
        node = node[key]
    return node


class _StdoutHandler(logging.Handler):
    """Each record as one line on the current sys.stdout (looked up per line: pytest swaps it)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stdout)


def setup_logging() -> None:
    """The `stages` logger: progress lines on stdout from the main process; other ranks log warnings
    only, so an 8-GPU run prints each line once. The root logger (libraries, Prefect) is left alone."""
    if not log.handlers:
        log.addHandler(_StdoutHandler())
        log.propagate = False
    log.setLevel(logging.INFO if is_main_process() else logging.WARNING)


def restore_outputs() -> str:
    """Under `dvc repro`, put the failed stage's outputs back as dvc.lock records them; says so (or why not)
    in a few words for the error line, "" outside DVC.

    DVC removes a stage's outputs before it runs the command, so without this a params typo found by the
    stage would leave the workspace without the previous good outputs (they stay in the DVC cache).
    `dvc checkout <stage>` cannot run here: DVC holds its write lock on these outputs for the command's
    duration, so the outputs are checked out in-process from the stage's dvc.lock entry, as that
    command would. Outputs not recorded yet (a first run) stay absent.
    """
    stage_name, root = os.environ.get("DVC_STAGE"), os.environ.get("DVC_ROOT")
    if not stage_name or not root or not is_main_process():
        return ""
    failed: list[str] = []
    try:
        from dvc.repo import Repo

        with Repo(root) as repo:
            [stage] = [stage for stage in repo.index.stages if stage.addressing == stage_name]
            restored = [out for out in stage.outs if out.hash_info]
            for out in restored:   # each on its own: the metrics come back though the model does not fit
                try:
                    if bad := corrupted_cache_files(out):   # DVC trusts a read-only cache file unread
                        failed.append(f"{out}: its DVC cache copy {bad[0]} is corrupted (delete it, then "
                                      f"`dvc pull {stage_name}` or rerun the stage)")
                        continue
                    out.checkout(force=True)
                except Exception as err:  # noqa: BLE001 - reported below, in the stage's one line
                    failed.append(f"{out}: {_first_line(err)}")
    except Exception as err:  # noqa: BLE001 - the stage's own error is the one to report
        failed.append(_first_line(err))
    if failed:   # --force: DVC would ask before overwriting what the failed write left
        return (f" (previous outputs not restored: {'; '.join(failed)}; `dvc checkout --force {stage_name}` "
                f"restores them)")
    return " (its previous outputs are restored from the DVC cache)" if restored else ""


def corrupted_cache_files(out: Any) -> list[str]:
    """The cache files of DVC output `out` whose bytes no longer have the md5 they are named by.

    DVC's local cache skips hashing a file whose mode is its read-only 0444 (dvc_data LocalHashFileDB.check),
    so a flipped byte is checked out as it is, with exit 0; the restore of a failed stage reads each file
    (a directory output: every file its .dir listing names) before it puts anything back."""
    import hashlib

    if out.hash_name != "md5":   # the legacy md5-dos2unix cache of DVC 2 hashes text otherwise: not checked
        return []
    oids = [out.hash_info.value]
    if out.hash_info.isdir:
        from dvc_data.hashfile.tree import Tree

        oids = [hash_info.value for _key, _meta, hash_info in Tree.load(out.cache, out.hash_info)]
    bad = []
    for oid in oids:   # (not parallel_r1.content_hash: every stage would then depend on it in dvc.yaml)
        path = out.cache.oid_to_path(oid)
        digest = hashlib.md5(usedforsecurity=False)
        with open(path, "rb") as stored:
            while block := stored.read(1 << 20):
                digest.update(block)
        if digest.hexdigest() != oid:
            bad.append(path)
    return bad


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _os_error_line(err: OSError) -> str:
    """An OSError as `<file>: <reason> (<errno name>)`; shutil's copy errors (a list of (src, dst, reason))
    name their first failed file instead of printing the list."""
    if isinstance(err, shutil.Error) and err.args and isinstance(err.args[0], list) and err.args[0]:
        first = err.args[0][0]
        _source, target, reason = first if len(first) == 3 else ("", "", str(first))
        more = f" (and {len(err.args[0]) - 1} more files)" if len(err.args[0]) > 1 else ""
        return f"{target}: {reason}{more}"
    name = errno.errorcode.get(err.errno or 0, type(err).__name__)
    where = f"{err.filename}: " if err.filename else ""
    return f"{where}{err.strerror or err} ({name})"


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def stage_main(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run a stage entry point: logging set up once, `PipelineError` (and an OSError: the system refused a
    read or write) turned into one line on stderr and exit 1, the outputs put back under DVC
    (`restore_outputs`). Ctrl-C and SIGTERM (what `make run` and a stopped flow send a stage) are one line
    and exit 130, the outputs put back the same way: DVC deleted them before the stage began and puts
    nothing back on an interrupt. The stage's MLflow run ends KILLED."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        setup_logging()
        in_main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _interrupt) if in_main_thread else None
        try:
            return func(*args, **kwargs)
        except PipelineError as err:
            print(f"error: {err}{restore_outputs()}", file=sys.stderr)
            sys.exit(1)
        except OSError as err:   # the system refused a read or write outside parallel_r1.io (a full disk)
            print(f"error: {_os_error_line(err)}{restore_outputs()}", file=sys.stderr)
            sys.exit(1)
        except KeyboardInterrupt as stop:
            why = f"{stop}" if str(stop).startswith("SIG") else "Ctrl-C"
            print(f"error: interrupted ({why}); this stage published nothing more{restore_outputs()}",
                  file=sys.stderr)
            sys.exit(130)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    return wrapper
