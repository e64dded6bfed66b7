"""Git and DVC remotes as the work pool uses them: how a sweep's commit and its results travel.

A sweep on a pool runs on machines that share nothing but two remotes: the project's git remote
(`origin` by default) and its DVC remote (`.dvc/config`, a filesystem path unless overridden in
`.dvc/config.local`). The parent pushes the commit the sweep runs from to `refs/sweeps/<sweep id>`;
each experiment runs in a private clone of that commit (so runs on one worker never share a
work tree), whose DVC cache is the worker clone's cache (inputs are fetched once per machine)
and whose remote is the worker clone's remote, resolved to an absolute URL (a relative path in
.dvc/config is relative to the clone it is read in). Results go back all or nothing (`push_experiment`):
the experiment's outputs and DVC's run cache to the DVC remote first, then its git ref to the git remote.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Collection

import yaml

from flows.dvc_runner import DvcCommandError, run_dvc
from parallel_r1 import mirror
from parallel_r1.errors import PipelineError

SWEEP_REF_PREFIX = "refs/sweeps/"
LOCALIZED = Path(".dvc") / "tmp" / "localized-remote.json"   # what localize_remote wrote into config.local


def git(args: list[str], cwd: str | os.PathLike, env: dict[str, str] | None = None) -> str:
    """`git <args>` in `cwd`; stdout; a one-line PipelineError with git's own last line on failure."""
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          check=False, env=None if env is None else {**os.environ, **env})
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        raise PipelineError(f"git {' '.join(args)} in {cwd}: {lines[-1].strip() if lines else 'failed'}")
    return done.stdout.strip()


def remote_url(root: Path, name: str) -> str:
    """The URL of git remote `name` of `root`, a local path made absolute."""
    url = git(["remote", "get-url", name], root)
    if "://" not in url and ":" not in url.split("/", 1)[0] and not os.path.isabs(url):
        url = str((root / url).resolve())
    return url


def unique_id(kind: str) -> str:
    """`<kind>-<UTC year to second>-<6 random hex>`: a sweep's or a fanned-out run's id, unique across clones
    and machines (refs/sweeps/<id> on the shared git remote, MLflow parent-run names), sortable by time."""
    return f"{kind}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def push_baseline(root: Path, git_remote: str, run_id: str, allowed: Collection[str] = (),
                  carried: Collection[str] = ()) -> str:
    """Push the commit the workers run to `refs/sweeps/<run_id>` on the git remote; returns that ref.

    Workers run from a commit, so tracked files must be committed, but those in `allowed` (left behind:
    dvc.lock) and those in `carried`: when one of these differs from HEAD, the pushed commit is HEAD plus the
    workspace's copy of it, made aside (a private index; the branch, the index and the work tree are
    untouched), so a run on another profile needs no hand commit of the params.yaml it composed. One line
    says which other files are not committed.
    """
    changed = git(["diff", "--name-only", "HEAD"], root).splitlines()  # staged or not
    files = [name for name in changed if name not in allowed and name not in carried]
    if files:
        raise PipelineError(f"work on a pool runs from a commit: commit or stash {', '.join(files[:5])}"
                            f"{' ...' if len(files) > 5 else ''} first")
    commit = "HEAD"
    if dirty := [name for name in changed if name in carried]:
        with tempfile.TemporaryDirectory() as tmp:
            index = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
            git(["read-tree", "HEAD"], root, index)
            git(["update-index", "--", *dirty], root, index)
            tree = git(["write-tree"], root, index)
        commit = git(["-c", "user.name=parallel-r1", "-c", "user.email=parallel-r1@localhost", "commit-tree",
                      tree, "-p", "HEAD", "-m", f"{run_id}: the workspace's {', '.join(dirty)}"], root)
    ref = f"{SWEEP_REF_PREFIX}{run_id}"
    git(["push", "--quiet", git_remote, f"{commit}:{ref}"], root)
    return ref


def dvc_settings(root: Path) -> dict[str, str]:
    """The worker clone's cache dir and default DVC remote (name, absolute URL) as `dvc config` keys."""
    from dvc.repo import Repo

    with Repo(os.fspath(root)) as repo:
        config = repo.config
        name = config["core"].get("remote")
        if not name:
            raise PipelineError(f"{root}/.dvc/config: no default DVC remote (dvc remote add -d storage URL)")
        url = str(config["remote"][name]["url"])
        cache_dir = repo.cache.local_cache_dir
    return {"core.remote": name, f"remote.{name}.url": url, "cache.dir": str(cache_dir)}


def private_clone(worker_clone: Path, git_remote: str, ref: str, destination: Path,
                  log: Callable[[str], None] = print) -> Path:
    """`destination`: a clone of `ref` from the worker clone's git remote, on its DVC cache and remote.

    The worker clone's .dvc/config.local (credentials, a remote overridden for this machine) is copied
    first; the remote URL and the cache dir are then written absolute. Its data mirror (git-ignored, so not in
    the clone) is the worker clone's, made by `make data` there if it is not yet, hard-linked and checked file
    by file against the data manifest (parallel_r1/mirror.py): the clone reads the data its worker reads.
    """
    settings = dvc_settings(worker_clone)
    if destination.exists():
        shutil.rmtree(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    url = remote_url(worker_clone, git_remote)
    git(["clone", "--quiet", "--no-checkout", "--origin", git_remote, url, str(destination)], worker_clone)
    git(["fetch", "--quiet", git_remote, ref], destination)
    git(["checkout", "--quiet", "--detach", "FETCH_HEAD"], destination)
    for key in ("user.name", "user.email"):  # DVC commits each experiment
        with contextlib.suppress(PipelineError):
            git(["config", key, git(["config", key], worker_clone)], destination)
    local = worker_clone / ".dvc" / "config.local"
    if local.is_file():
        shutil.copy2(local, destination / ".dvc" / "config.local")
    for key, value in settings.items():
        _dvc_config(destination, key, value)
    mirror.fill_clone(worker_clone, destination, log=log)
    return destination


def stage_outs(root: Path, stages: list[str]) -> dict[str, str]:
    """{output path: DVC hash} of `stages` in root/dvc.lock (`<stage>@<key>` for foreach entries)."""
    lock_path = root / "dvc.lock"
    if not lock_path.is_file():
        return {}
    lock = (yaml.safe_load(lock_path.read_text()) or {}).get("stages") or {}
    found: dict[str, str] = {}
    for stage in stages:
        for out in (lock.get(stage) or {}).get("outs") or []:
            found[out["path"]] = out.get("md5") or out.get("etag") or out.get("checksum") or ""
    return found


def push_experiment(work: Path, git_remote: str, name: str, echo: Callable[[str], object] = print) -> None:
    """Push experiment `name` of the clone `work` all or nothing: its data first, then its git ref.

    `dvc exp push --run-cache` pushes the ref before the data, so a DVC remote that refuses writes left a ref
    on the git remote whose outputs no clone can pull. Here `dvc push --run-cache` of the workspace (which
    `dvc exp run` leaves holding the experiment's outputs and dvc.lock) goes first; only when it succeeded
    does `dvc exp push --no-cache` send the ref. A refused data push raises one line, DVC's reason.
    """
    try:
        run_dvc(["push", "--run-cache"], cwd=work, echo=echo)
    except DvcCommandError as err:
        why = f"its data did not reach the DVC remote, so its git ref was not pushed: {err}"
        raise type(err)(why) from None
    run_dvc(["exp", "push", "--no-cache", git_remote, name], cwd=work, echo=echo)


def localize_remote(root: Path) -> str | None:
    """Write the default DVC remote's absolute path into `.dvc/config.local` when `.dvc/config` gives it as
    a relative path; returns the path written (or kept), else None. `make setup` runs it.

    Why: `dvc exp pull` reads each experiment's `.dvc/config` from its git commit, where a relative path
    resolves against the root of git's tree (`/parallel-r1-dvc-remote`), not this clone, and fetched nothing
    with exit 0; config.local is read from the clone for every commit. A URL (s3://...) or an absolute path
    means the same everywhere and needs nothing. What it writes is recorded in `.dvc/tmp/` (`LOCALIZED`), so
    a later setup updates it (a moved clone) or removes it (the committed remote no longer relative), and a
    URL a user set in config.local themselves is never touched.
    """
    import json

    from configobj import ConfigObj

    committed = ConfigObj(str(root / ".dvc" / "config"))
    name = committed.get("core", {}).get("remote")
    section = f'remote "{name}"'
    url = committed.get(section, {}).get("url") if name else None
    local_file, record = root / ".dvc" / "config.local", root / LOCALIZED
    local_url = ConfigObj(str(local_file)).get(section, {}).get("url") if local_file.is_file() else None
    try:
        written = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        written = {}
    ours = local_url is not None and written == {"remote": name, "url": local_url}
    if not url or re.match(r"\w+://", url) or os.path.isabs(os.path.expanduser(url)):
        if ours:
            _dvc_config(root, f"remote.{name}.url", None)
            record.unlink()
        return None
    if local_url is not None and not ours:
        return None   # the user's own
    absolute = os.path.normpath(os.path.join(os.path.abspath(root / ".dvc"), url))  # as DVC resolves it
    if local_url != absolute:
        _dvc_config(root, f"remote.{name}.url", absolute)
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"remote": name, "url": absolute}), encoding="utf-8")
    return absolute


def _dvc_config(root: Path, key: str, value: str | None) -> None:
    """`dvc config --local key value` in `root`; value None unsets the key."""
    import sys

    setting = [key] if value is None else [key, value]
    done = subprocess.run([sys.executable, "-m", "dvc", "config", "--local",
                           *(["--unset"] if value is None else []), *setting], cwd=root,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["failed"])[-1]
        raise PipelineError(f"dvc config --local {' '.join(setting)} in {root}: {last}")


if __name__ == "__main__":  # `make setup`: python -m flows.remote localize-remote
    import sys

    if sys.argv[1:] != ["localize-remote"]:
        sys.exit("usage: python -m flows.remote localize-remote")
    written = localize_remote(Path.cwd())
    if written:
        print(f".dvc/config.local: the DVC remote is {written} (dvc exp pull reads it in every commit)")
