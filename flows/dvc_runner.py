"""DVC as the flows see it: the stage plan, one `dvc` subprocess per step, and its one-line error.

DVC runs in a subprocess with the flow's interpreter first on PATH, so the stage commands of
dvc.yaml (`python -m stages.<name>`) run in the same environment as the flow; in its own session, under
flows/dvc_supervisor.py, so it stops with its flow run and dies with the process that started it. Its
output is streamed line by line into the Prefect task log. A failure becomes `DvcCommandError` with the
stage's own `error: ...` line when there is one (stages print it, see stages/common.py), else
DVC's `ERROR: ...` line; lock contention is marked transient so the task may retry it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Callable, Iterable, Mapping

from parallel_r1.errors import RESOURCE_MARK, PipelineError

# Messages of failures that a later attempt can clear: another DVC or git process holds a lock, or a stage
# found too little free memory (parallel_r1.errors.ResourceShortage).
TRANSIENT_PATTERNS = (
    re.compile(r"Unable to acquire lock"),
    re.compile(r"index\.lock'?: File exists"),
    re.compile(re.escape(RESOURCE_MARK)),
)


# Runs each DVC command (`dvc_command`); the seconds DVC and its stage get to exit on SIGTERM before SIGKILL.
SUPERVISOR = Path(__file__).with_name("dvc_supervisor.py")
STOP_GRACE_S = 10.0


class DvcCommandError(PipelineError):
    """A `dvc` command failed; the message is the one line that says why."""


class TransientDvcError(DvcCommandError):
    """A `dvc` command failed for a reason outside the stage (lock contention): worth a retry."""


def plan_stages(targets: Iterable[str] = (), root: str | os.PathLike = ".") -> list[str]:
    """Addresses of the stages `dvc repro <targets>` would visit, upstream first.

    The same walk as DVC's own `repro` (post-order over the dependency graph, frozen stages cut
    off). A target is a stage or, unlike `dvc repro`, also an output path (`reports/table1.md`),
    which stands for the stage that writes it; no targets means the whole dvc.yaml.
    """
    from dvc.exceptions import DvcException
    from dvc.repo import Repo
    from dvc.repo.reproduce import get_active_graph, plan_repro

    try:
        with contextlib.chdir(root), Repo(os.fspath(root)) as repo:  # DVC resolves targets from the cwd
            stages = [info.stage for target in (list(targets) or ["dvc.yaml"])
                      for info in repo.stage.collect_granular(target)]
            stages = list(dict.fromkeys(stages))
            return [stage.addressing for stage in plan_repro(get_active_graph(repo.index.graph), stages)]
    except DvcException as err:
        first = str(err).strip().splitlines()[0]
        raise PipelineError(f"dvc.yaml: cannot plan targets {list(targets) or 'all'}: {first}") from None


def target_stages(targets: Iterable[str], root: str | os.PathLike = ".") -> list[str]:
    """The addresses of the stages `targets` name (a stage, or an output path standing for the stage that
    writes it), nothing upstream: what `dvc repro` takes as targets."""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    try:
        with contextlib.chdir(root), Repo(os.fspath(root)) as repo:
            stages = [info.stage.addressing for target in targets
                      for info in repo.stage.collect_granular(target)]
            return list(dict.fromkeys(stages))
    except DvcException as err:
        first = str(err).strip().splitlines()[0]
        raise PipelineError(f"dvc.yaml: cannot find targets {list(targets)}: {first}") from None


def plan_graph(targets: Iterable[str] = (), root: str | os.PathLike = ".") -> dict[str, list[str]]:
    """`plan_stages` with each stage's upstream stages (those of the plan it depends on directly), in
    DVC's order: what a scheduler needs to run independent stages at once."""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo
    from dvc.repo.reproduce import get_active_graph, plan_repro

    try:
        with contextlib.chdir(root), Repo(os.fspath(root)) as repo:
            graph = get_active_graph(repo.index.graph)
            stages = [info.stage for target in (list(targets) or ["dvc.yaml"])
                      for info in repo.stage.collect_granular(target)]
            planned = plan_repro(graph, list(dict.fromkeys(stages)))
            return {stage.addressing: [up.addressing for up in graph.successors(stage) if up in planned]
                    for stage in planned}
    except DvcException as err:
        first = str(err).strip().splitlines()[0]
        raise PipelineError(f"dvc.yaml: cannot plan targets {list(targets) or 'all'}: {first}") from None


def dvc_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default os.environ) with this interpreter's bin folder first on PATH."""
    out = dict(os.environ if env is None else env)
    out["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), out.get("PATH", "")])
    return out


def dvc_command(args: list[str]) -> list[str]:
    """`python -m dvc <args>` under flows/dvc_supervisor.py, started in its own session: a stopped flow run
    stops DVC and its stage with one killpg (`_stop_group`), and a flow-run process that dies however (its
    worker killed with its process group, which the new session leaves out) takes them with it."""
    return [sys.executable, "-I", str(SUPERVISOR), str(os.getpid()), str(STOP_GRACE_S),
            sys.executable, "-m", "dvc", *args]


def run_dvc(args: list[str], cwd: str | os.PathLike = ".", env: Mapping[str, str] | None = None,
            echo: Callable[[str], object] = print) -> list[str]:
    """Run `dvc <args>`; every output line goes to `echo`; returns the lines, raises on failure."""
    command = dvc_command(args)
    lines: deque[str] = deque(maxlen=400)
    # Own process group: a cancelled flow run stops DVC *and* the stage command it started.
    with subprocess.Popen(command, cwd=cwd, env=dvc_env(env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, errors="replace",
                          start_new_session=True) as proc:
        assert proc.stdout is not None  # stdout=PIPE
        try:
            for raw in proc.stdout:
                line = raw.rstrip("\n")
                lines.append(line)
                echo(line)
            proc.wait()
        except BaseException:
            _stop_group(proc)
            raise
    if proc.returncode != 0:
        raise error_from_output(list(lines), f"dvc {' '.join(args)}")
    return list(lines)


class DvcStream:
    """One `dvc <args>` subprocess whose output is read line by line, with one line of look-ahead, so a
    caller can hand each stage's lines to the Prefect task that stands for that stage.

        with DvcStream(["repro"], root, env) as stream:
            for line in stream: ...          # stream.push_back(line): the next read returns it again
        # leaving the block waits for DVC and raises `error_from_output` when it failed
    """

    def __init__(self, args: list[str], cwd: str | os.PathLike = ".", env: Mapping[str, str] | None = None):
        self.args, self.cwd, self.env = args, cwd, env
        self.lines: deque[str] = deque(maxlen=400)   # the tail, for the one-line error
        self._pending: list[str] = []
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> DvcStream:
        # Own process group: a cancelled flow run or Ctrl-C stops DVC *and* the stage command it started.
        self._proc = subprocess.Popen(dvc_command(self.args), cwd=self.cwd,
                                      env=dvc_env(self.env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, text=True, errors="replace",
                                      start_new_session=True)
        return self

    def __iter__(self) -> DvcStream:
        return self

    def __next__(self) -> str:
        if self._pending:
            return self._pending.pop()
        assert self._proc is not None and self._proc.stdout is not None  # entered, stdout=PIPE
        raw = self._proc.stdout.readline()
        if not raw:
            raise StopIteration
        line = raw.rstrip("\n")
        self.lines.append(line)
        return line

    def push_back(self, line: str) -> None:
        self._pending.append(line)

    def error(self) -> DvcCommandError | None:
        """After the output ended: DVC's failure as one line, or None when it succeeded."""
        assert self._proc is not None
        if self._proc.wait() == 0:
            return None
        return error_from_output(list(self.lines), f"dvc {' '.join(self.args)}")

    def __exit__(self, kind, value, traceback) -> None:
        assert self._proc is not None
        with self._proc:
            if kind is not None:
                _stop_group(self._proc)
                return
            for _ in self:  # output nobody read
                pass
        if (failure := self.error()) is not None:
            raise failure


def dvc_json(args: list[str], cwd: str | os.PathLike = ".") -> object:
    """Parsed stdout of a `dvc ... --json` command (stderr kept apart from the JSON)."""
    done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, env=dvc_env(), capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        raise error_from_output(done.stderr.splitlines() + done.stdout.splitlines(), f"dvc {' '.join(args)}")
    return json.loads(done.stdout)


def error_from_output(lines: list[str], command: str) -> DvcCommandError:
    """The one line that says why a `dvc` command failed, classified transient or not."""
    text = "\n".join(lines)
    transient = any(pattern.search(text) for pattern in TRANSIENT_PATTERNS)
    stage_errors = [line.strip() for line in lines if line.startswith("error: ")]
    dvc_errors = [line.strip() for line in lines if line.startswith("ERROR: ")]
    non_empty = [line.strip() for line in lines if line.strip()]
    line = (stage_errors or dvc_errors or non_empty or [f"{command} failed without output"])[-1]
    return (TransientDvcError if transient else DvcCommandError)(line)


def experiment_metrics(show: list[dict], names: Iterable[str]) -> dict[str, dict[str, float]]:
    """Numeric metrics of named experiments from `dvc exp show --json` output.

    Keys are dotted keys inside the metrics file; prefixed with `<file>:` only where two
    files of one experiment share a key.
    """
    wanted = set(names)
    found: dict[str, dict[str, float]] = {}
    for baseline in show:
        for experiment in baseline.get("experiments") or []:
            for rev in experiment.get("revs") or []:
                if rev.get("name") in wanted:
                    found[rev["name"]] = _flat_metrics((rev.get("data") or {}).get("metrics") or {})
    return found


def workspace_metrics(root: str | os.PathLike = ".") -> dict[str, float]:
    """The workspace's numeric metrics as `dvc metrics show --json` reads them, flat (dotted keys)."""
    shown = dvc_json(["metrics", "show", "--json"], cwd=root)
    revisions = shown if isinstance(shown, dict) else {}
    workspace = revisions.get("") or revisions.get("workspace") or {}  # DVC 3 names the workspace ""
    return _flat_metrics(workspace.get("data") or {})


def _stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, signum)
            proc.wait(timeout=grace_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def _flat_metrics(metrics: Mapping[str, Mapping]) -> dict[str, float]:
    per_file = {path: _numbers(entry.get("data") or {}) for path, entry in metrics.items()}
    counts: dict[str, int] = {}
    for values in per_file.values():
        for key in values:
            counts[key] = counts.get(key, 0) + 1
    return {(key if counts[key] == 1 else f"{path}:{key}"): value
            for path, values in per_file.items() for key, value in values.items()}


def _numbers(data: Mapping, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            out.update(_numbers(value, f"{prefix}{key}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = float(value)
    return out
