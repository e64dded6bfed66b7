"""`make data`: fill the data mirror (params.yaml data.mirror_dir, `mirror/` in every profile) and verify it.

    python -m parallel_r1.mirror            # what `make data` runs; `make run` runs it first, every time

The stages read only data.mirror_dir, whose files dvc.yaml lists as dependencies; this fills it, from the
first source that has the files:

1. a local mirror: env PARALLEL_R1_DATA if set, else `../shared/data` beside the project (a lab's shared
   copy). Its files are copied, not linked: DVC hashes the dependencies it reads, and a link would let an
   edit of the shared copy change a project's data behind dvc.lock;
2. else the datasets' public sources, at the commits parallel_r1/data_manifest.yaml pins
   (parallel_r1/fetch.py), converted into the mirror's layout.

Either way every file is checked against the manifest's sha256 before it is written, and a file already in the
mirror is checked on every run (12 MB: a fraction of a second), so a run on a verified mirror changes nothing.
A mismatch is refused with one line naming the file: nothing is written for it. A private clone of a sweep
experiment or a fanned-out stage gets its mirror from the worker clone's (`fill_clone`), checked the same way.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Callable

import yaml

from parallel_r1 import fetch
from parallel_r1.errors import PipelineError

MANIFEST = Path(__file__).with_name("data_manifest.yaml")
MIRROR_ENV = "PARALLEL_R1_DATA"
DEFAULT_MIRROR = "mirror"      # the folder `make data` fills where params.yaml names none
DOWNLOADS = ".downloads"       # the download cache, in the mirror folder; removed once the mirror is whole
Log = Callable[[str], None]


def load_manifest(path: Path = MANIFEST) -> dict[str, dict]:
    """{mirror file (relative path): its manifest entry}."""
    return dict(yaml.safe_load(path.read_text(encoding="utf-8"))["files"])


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def mirror_path(root: Path) -> Path | None:
    """data.mirror_dir of root/params.yaml, relative to `root`; None when the project names none."""
    params_file = root / "params.yaml"
    params = yaml.safe_load(params_file.read_text(encoding="utf-8")) if params_file.is_file() else None
    data = params.get("data") if isinstance(params, dict) else None
    configured = data.get("mirror_dir") if isinstance(data, dict) else None
    return root / str(configured) if configured else None


def local_source(root: Path) -> Path | None:
    """The local mirror to copy from: $PARALLEL_R1_DATA (which must exist), else ../shared/data if present."""
    named = os.environ.get(MIRROR_ENV)
    if named:
        if not Path(named).is_dir():
            raise PipelineError(f"${MIRROR_ENV}={named}: no such folder (unset it to download the datasets)")
        return Path(named)
    shared = root.resolve().parent / "shared" / "data"
    return shared if shared.is_dir() else None


def _matches(path: Path, entry: dict) -> bool:
    return path.is_file() and sha256_file(path) == entry["sha256"]


def _install(target: Path, expected: str, fill: Callable[[Path], None], what: str) -> None:
    """Write `target` through a temporary sibling that `fill` writes, renamed only if its sha256 is
    `expected`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        fill(tmp)
        got = sha256_file(tmp)
        if got != expected:
            raise PipelineError(f"{what}: sha256 {got}, the data manifest ({MANIFEST.name}) expects "
                                f"{expected}: refused, {target} not written")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _copy_or_link(source: Path, link: bool) -> Callable[[Path], None]:
    def fill(tmp: Path) -> None:
        if link:
            try:
                os.link(source, tmp)
                return
            except OSError:   # another file system, or links refused: a copy
                pass
        shutil.copyfile(source, tmp)
    return fill


def copy_verified(source: Path, dest: Path, manifest: dict[str, dict], link: bool = False,
                  log: Log = print) -> list[str]:
    """Copy (or, with `link`, hard-link) the manifest's files from mirror `source` into `dest`; the names
    `source` lacks are returned. Every file of `source` is checked first: one that differs from the manifest
    is refused, naming it, before anything is written. Files of `dest` that already match are left alone."""
    todo, missing = [], []
    for name, entry in manifest.items():
        if _matches(dest / name, entry):
            continue
        if not (source / name).is_file():
            missing.append(name)
            continue
        got = sha256_file(source / name)
        if got != entry["sha256"]:
            raise PipelineError(f"{source / name}: sha256 {got}, the data manifest ({MANIFEST.name}) expects "
                                f"{entry['sha256']}: refused, nothing written to {dest}")
        todo.append(name)
    for name in todo:
        _install(dest / name, manifest[name]["sha256"], _copy_or_link(source / name, link),
                 str(source / name))
        log(f"{dest / name}: {'linked' if link else 'copied'} from {source}, sha256 checked")
    return missing


def _writer(data: bytes) -> Callable[[Path], None]:
    def fill(tmp: Path) -> None:
        tmp.write_bytes(data)
    return fill


def _download_all(names: list[str], dest: Path, manifest: dict[str, dict], local: Path | None,
                  log: Log) -> dict[str, str]:
    """Download and convert `names` (not in the local mirror `local`, if any) into `dest`; {name: its one-line
    error} of those that failed."""
    errors: dict[str, str] = {}
    rows_of: dict[Path, list[dict]] = {}
    for name in names:
        entry = manifest[name]
        try:
            label = f"{name} (not in {local})" if local is not None else name
            path = fetch.download(entry["source"], dest / DOWNLOADS, label)
            if path not in rows_of:
                rows_of[path] = fetch.read_rows(path)
            url = fetch.source_url(entry["source"])
            try:
                data = fetch.convert(rows_of[path], entry.get("convert"), label)
                _install(dest / name, entry["sha256"], _writer(data), f"{name} converted from {url}")
            except PipelineError:
                path.unlink(missing_ok=True)   # not what the manifest pins: the next run downloads it again
                raise
            log(f"{dest / name}: converted from {url}, sha256 checked")
        except PipelineError as err:
            errors[name] = str(err)
    return errors


def ensure(dest: Path, root: Path, manifest: dict[str, dict] | None = None, log: Log = print) -> None:
    """Make `dest` hold every manifest file, verified: from the local mirror, else downloaded (module doc)."""
    manifest = manifest if manifest is not None else load_manifest()
    started = time.monotonic()
    pending = {name: entry for name, entry in manifest.items() if not _matches(dest / name, entry)}
    if pending:
        local = local_source(root)
        names = copy_verified(local, dest, pending, log=log) if local is not None else list(pending)
        errors = _download_all(names, dest, manifest, local, log) if names else {}
        if errors:
            first, *others = errors
            more = f" (not written either: {', '.join(others)})" if others else ""
            raise PipelineError(errors[first] + more)
        shutil.rmtree(dest / DOWNLOADS, ignore_errors=True)
    seconds = time.monotonic() - started
    log(f"{dest}: {len(manifest)} files verified against {MANIFEST.name} ({seconds:.1f} s)")


def fill_clone(worker_clone: Path, clone: Path, manifest: dict[str, dict] | None = None,
               log: Log = print) -> None:
    """A private clone's mirror from its worker clone's (verified, filled first if needed), hard-linked where
    possible and checked file by file; nothing to do when data.mirror_dir lies outside the clone (both read
    that folder) or the project names none. Links are safe here, unlike from a shared copy: the worker's
    mirror is written only by this module, which replaces a file (a new inode) and never edits one."""
    target = mirror_path(clone)
    if target is None or not target.resolve().is_relative_to(clone.resolve()):
        return
    manifest = manifest if manifest is not None else load_manifest()
    source = mirror_path(worker_clone) or worker_clone / target.relative_to(clone)
    ensure(source, worker_clone, manifest, log=log)
    missing = copy_verified(source, target, manifest, link=True, log=log)
    if missing:
        raise PipelineError(f"{source}: {', '.join(missing)} missing after make data")


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="the project (default: the current folder)")
    parser.add_argument("--dest", help="the folder to fill (default: params.yaml data.mirror_dir)")
    args = parser.parse_args(argv)
    root = Path(args.root)
    try:
        ensure(Path(args.dest) if args.dest else mirror_path(root) or root / DEFAULT_MIRROR, root)
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except OSError as err:   # a full disk, a read-only folder
        where = f"{err.filename}: " if err.filename else ""
        print(f"error: {where}{err.strerror or err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
