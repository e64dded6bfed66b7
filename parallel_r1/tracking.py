"""MLflow tracking for every stage and flow: one run per stage, nested under its flow's run.

    from parallel_r1 import tracking
    with tracking.stage_run(stage="sft", config="seen", params=params, tags={"variant": "seen"}):
        trainer = SFTTrainer(..., args=SFTConfig(report_to=tracking.report_to()))
        tracking.log_metrics({"parallel_block_rate": 0.4})
        tracking.log_model_reference("models/sft_seen")

Why it looks like this:
- A stage run is the *active* MLflow run of the stage process, so the HF/TRL Trainer's
  `MLflowCallback` (transformers 5.19) logs its per-step metrics into it: the callback only
  starts a run of its own when none is active, or when `MLFLOW_RUN_ID` / `MLFLOW_NESTED_RUN`
  are set — so `stage_run` clears those two for its duration, and turns off
  `HF_MLFLOW_LOG_ARTIFACTS` (weights never go to MLflow; `log_model_reference` logs a path
  and a hash instead).
- Flows (Prefect) open a `parent_run` and hand its id to `dvc repro` subprocesses through
  env `PARALLEL_R1_PARENT_RUN_ID`; each stage run nests under it.
- Tracking never fails a stage: when MLflow is off (`PARALLEL_R1_TRACKING=off`) everything
  is a no-op; when the server is unreachable the stage prints one warning line and goes on.
- The sqlite default (`sqlite:///mlflow.db`) is resolved against the project root
  (env `DVC_ROOT`, which DVC also sets inside `dvc exp run --temp` directories), so runs
  from temporary experiment folders land in the project's database.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from parallel_r1.content_hash import dvc_md5, locked_md5
from parallel_r1.errors import PipelineError

SWITCH_ENV = "PARALLEL_R1_TRACKING"
PARENT_ENV = "PARALLEL_R1_PARENT_RUN_ID"
DEFAULT_URI = "sqlite:///mlflow.db"
DEFAULT_EXPERIMENT = "parallel-r1"

# Tag names other code filters on (the reward-schedule report, the sweep table).
TAG_STAGE = "stage"
TAG_CONFIG = "config"
TAG_DVC_STAGE = "dvc_stage"
TAG_DVC_EXP = "dvc_exp_name"
TAG_GIT_COMMIT = "git_commit"
TAG_PROFILE = "profile"
TAG_PARAMS_HASH = "params_hash"
TAG_VARIANT = "variant"
TAG_REWARD_SCHEDULE = "reward_schedule"
# The process that owns a run, so a later run can tell a live run from one orphaned by kill -9.
TAG_HOST = "process.host"
TAG_PID = "process.pid"
TAG_STARTED = "process.started"

# Env vars of transformers' MLflowCallback, pinned while a stage run is active (see module doc).
_CALLBACK_ENV = {"MLFLOW_RUN_ID": None, "MLFLOW_NESTED_RUN": "false",
                 "HF_MLFLOW_LOG_ARTIFACTS": "false", "MLFLOW_FLATTEN_PARAMS": "true"}
# A dead server should cost seconds, not MLflow's default minutes of retries.
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}

log = logging.getLogger(__name__)


@dataclass
class _State:
    """What this process knows: the stage run in progress, and the URIs where MLflow failed."""

    stage_run_id: str | None = None
    broken_uris: set[str] = field(default_factory=set)


_STATE = _State()


def enabled() -> bool:
    """False when env PARALLEL_R1_TRACKING is off/0/false/no, on every process but the main one of
    a multi-process launch (env RANK, set by `accelerate launch` / torchrun, other than 0: one
    stage, one run), or when MLflow at the tracking URI already failed in this process (one
    warning, then silence)."""
    switch = os.environ.get(SWITCH_ENV, "on").strip().lower()
    return switch not in {"off", "0", "false",
                          "no"} and is_main_process() and tracking_uri() not in _STATE.broken_uris


def is_main_process() -> bool:
    """Rank 0 under `accelerate launch` / torchrun (which set RANK), else the only process (RANK unset
    or empty)."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


def project_root() -> Path:
    """The DVC project root: env DVC_ROOT (set by DVC for stage commands), else the cwd."""
    return Path(os.environ.get("DVC_ROOT") or os.getcwd()).resolve()


def tracking_uri(params: Mapping[str, Any] | None = None) -> str:
    """env MLFLOW_TRACKING_URI, else params `tracking.tracking_uri`, else the project's sqlite file."""
    uri = (os.environ.get("MLFLOW_TRACKING_URI") or _tracking_section(params).get("tracking_uri")
           or DEFAULT_URI)
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        uri = prefix + str(project_root() / uri[len(prefix):])
    return uri


def experiment_name(params: Mapping[str, Any] | None = None) -> str:
    """env MLFLOW_EXPERIMENT_NAME, else params `tracking.experiment`, else "parallel-r1"."""
    return (os.environ.get("MLFLOW_EXPERIMENT_NAME") or _tracking_section(params).get("experiment")
            or DEFAULT_EXPERIMENT)


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested params as dotted keys -> strings, each cut to MLflow's value length limit."""
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_params(value, prefix=f"{name}."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) > MAX_PARAM_VAL_LENGTH:
            text = text[: MAX_PARAM_VAL_LENGTH - 3] + "..."
        flat[name] = text
    return flat


def params_hash(params: Mapping[str, Any]) -> str:
    """A short stable hash of the params, to find runs made with identical settings."""
    canonical = json.dumps(params, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:12]


def git_commit(root: Path | None = None) -> str:
    """HEAD of the project's git repository, or "unknown"."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root or project_root(), capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def run_tags(stage: str, config: str | None, params: Mapping[str, Any] | None,
             tags: Mapping[str, Any] | None) -> dict[str, str]:
    """The tags of a stage run: identity, git commit, DVC stage and experiment, profile, params hash."""
    params = params or {}
    out = {TAG_STAGE: stage, TAG_GIT_COMMIT: git_commit(), TAG_PARAMS_HASH: params_hash(params),
           TAG_DVC_STAGE: os.environ.get("DVC_STAGE") or (f"{stage}@{config}" if config else stage)}
    if config:
        out[TAG_CONFIG] = config
    if params.get("profile"):
        out[TAG_PROFILE] = str(params["profile"])
    if os.environ.get("DVC_EXP_NAME"):
        out[TAG_DVC_EXP] = os.environ["DVC_EXP_NAME"]
    out.update({key: str(value) for key, value in (tags or {}).items() if value is not None})
    return out


@contextlib.contextmanager
def stage_run(stage: str, config: str | None = None, params: Mapping[str, Any] | None = None,
              tags: Mapping[str, Any] | None = None, label: str | None = None) -> Iterator[str | None]:
    """Make `<stage>@<config>` the active MLflow run for the block; yields its id (None when off).

    `label` is appended to the run's name in brackets (an RL run's reward schedule: runs compared side
    by side in the UI say what they compare). Nested under the run in env PARALLEL_R1_PARENT_RUN_ID when
    set. Ends FINISHED, or FAILED when the block raises (the exception goes on untouched).
    """
    name = (f"{stage}@{config}" if config else stage) + (f" ({label})" if label else "")
    run_id = _create_run(name, params, run_tags(stage, config, params, tags), os.environ.get(PARENT_ENV))
    if run_id is None:
        yield None
        return
    saved = {key: os.environ.get(key) for key in _CALLBACK_ENV}
    # nested=True only matters when some other run is already active in this process.
    active = _guard("start the stage run", lambda: _mlflow().start_run(run_id=run_id, nested=True))
    if active is None:
        yield None
        return
    _STATE.stage_run_id = run_id
    _set_env(_CALLBACK_ENV)
    error: BaseException | None = None
    try:
        yield run_id
    except BaseException as err:
        error = err
        raise
    finally:
        _set_env(saved)
        _STATE.stage_run_id = None
        _guard("flush async logging", lambda: _mlflow().flush_async_logging())
        _guard("end the stage run", lambda: _mlflow().end_run(status=_end_status(error)))


@contextlib.contextmanager
def parent_run(name: str, params: Mapping[str, Any] | None = None, tags: Mapping[str, Any] | None = None,
               parent_run_id: str | None = None, experiment: str | None = None) -> Iterator[str | None]:
    """A run for a flow or pipeline invocation, driven by id (not made active); yields the id.

    Hand the id to child processes in env PARALLEL_R1_PARENT_RUN_ID (see `child_env`).
    `experiment` defaults to `experiment_name(params)`.
    """
    all_tags = {TAG_GIT_COMMIT: git_commit(), **{k: str(v) for k, v in (tags or {}).items() if v is not None}}
    run_id = _create_run(name, params, all_tags, parent_run_id, experiment)
    error: BaseException | None = None
    try:
        yield run_id
    except BaseException as err:
        error = err
        raise
    finally:
        if run_id is not None:
            _guard("end the run", lambda: _client().set_terminated(run_id, status=_end_status(error)))


def child_env(run_id: str | None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default os.environ) with the parent run id and an absolute tracking URI for children."""
    out = dict(os.environ if env is None else env)
    if run_id:
        out[PARENT_ENV] = run_id
    if enabled():
        out["MLFLOW_TRACKING_URI"] = tracking_uri()
    return out


def report_to() -> str:
    """"mlflow" inside a live stage run (the Trainer then logs into it), else "none"."""
    disabled = os.environ.get("DISABLE_MLFLOW_INTEGRATION", "").upper() == "TRUE"
    return "mlflow" if enabled() and _STATE.stage_run_id and not disabled else "none"


def log_metrics(metrics: Mapping[str, Any], step: int | None = None, run_id: str | None = None) -> None:
    """Log numeric metrics to `run_id` or the active stage run; None values are skipped."""
    values = {}
    for key, value in metrics.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PipelineError(f"tracking.log_metrics: metric {key!r} is not a number ({value!r})")
        values[key] = float(value)
    target = run_id or _STATE.stage_run_id
    if not values or target is None or not enabled():
        return
    from mlflow.entities import Metric
    from mlflow.utils.time import get_current_time_millis

    now = get_current_time_millis()
    batch = [Metric(key, value, now, step or 0) for key, value in values.items()]
    _guard("log metrics", lambda: _client().log_batch(target, metrics=batch))


def set_tags(tags: Mapping[str, Any]) -> None:
    """Set string tags on the active stage run (a no-op without one)."""
    run_id = _STATE.stage_run_id
    if run_id is None or not enabled():
        return
    _guard("set tags", lambda: _set_tags(run_id, {key: str(value) for key, value in tags.items()}))


def log_artifact(path: str | os.PathLike, artifact_path: str | None = None) -> None:
    """Copy a small file (report, plot) into the active stage run's artifacts."""
    path = Path(path)
    if not path.exists():
        raise PipelineError(f"tracking.log_artifact: {path} not found")
    if _STATE.stage_run_id is None or not enabled():
        return
    run_id = _STATE.stage_run_id
    _guard("log an artifact", lambda: _client().log_artifact(run_id, str(path), artifact_path))


def log_model_reference(path: str | os.PathLike) -> dict[str, str]:
    """Record where a model is and its content hash as tags `model.<name>.*` — never the weights.

    The hash is DVC's md5 (a directory's md5 ends in ".dir"): read from dvc.lock when another
    stage produced the folder, else computed here with DVC's algorithm — the running stage's own
    outputs are not in dvc.lock until it ends. Returns the tags it logged.
    """
    path = Path(path)
    if not path.exists():
        raise PipelineError(f"tracking.log_model_reference: {path} not found")
    md5, source = locked_md5(path, project_root(), skip_stage=os.environ.get("DVC_STAGE")), "dvc.lock"
    if md5 is None:
        md5, source = dvc_md5(path), "computed"
    name = path.name
    try:
        shown = path.resolve().relative_to(project_root()).as_posix()
    except ValueError:
        shown = str(path)
    tags = {f"model.{name}.path": shown, f"model.{name}.md5": md5, f"model.{name}.md5_source": source}
    run_id = _STATE.stage_run_id
    if run_id is not None and enabled():
        _guard("log a model reference", lambda: _set_tags(run_id, tags))
    return tags


def run_url(run_id: str) -> str | None:
    """The MLflow UI address of a run when tracking goes to a server, else None."""
    uri = tracking_uri()
    if not uri.startswith(("http://", "https://")) or not enabled():
        return None
    run = _guard("read the run", lambda: _client().get_run(run_id))
    return f"{uri.rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{run_id}" if run else None


def child_runs(run_id: str | None) -> list[dict[str, Any]] | None:
    """The runs nested directly under `run_id`, oldest first: name, status, start and end (epoch ms; end
    None while running), the DVC stage it ran for (tag `dvc_stage`; "" for other runs). None when tracking is
    off or the store cannot be read."""
    if not run_id or not enabled():
        return None

    def search() -> list[dict[str, Any]]:
        client = _client()
        experiment = client.get_run(run_id).info.experiment_id
        runs = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{run_id}'",
                                  order_by=["attributes.start_time ASC"], max_results=10_000)
        return [{"name": run.info.run_name, "status": run.info.status, "start_ms": run.info.start_time,
                 "end_ms": run.info.end_time, "dvc_stage": run.data.tags.get(TAG_DVC_STAGE, "")}
                for run in runs]

    return _guard("list the invocation's stage runs", search, disable=False)


def process_tags(pid: int | None = None) -> dict[str, str]:
    """Host, pid and start time of a process (default: this one): who owns a run."""
    import psutil

    process = psutil.Process(pid)
    return {TAG_HOST: socket.gethostname(), TAG_PID: str(process.pid),
            TAG_STARTED: f"{process.create_time():.2f}"}


def _is_orphaned(tags: Mapping[str, str]) -> bool:
    """A RUNNING run whose owner, on this host, is gone (its pid dead or reused by a later process).

    Runs of other hosts, and runs made before these tags existed, are never judged: only the
    owner's machine can tell whether the process is alive.
    """
    import psutil

    if tags.get(TAG_HOST) != socket.gethostname() or not str(tags.get(TAG_PID, "")).isdigit():
        return False
    try:
        return process_tags(int(tags[TAG_PID]))[TAG_STARTED] != tags.get(TAG_STARTED)
    except psutil.Error:   # no such process (or not ours to inspect: then it is alive)
        return not psutil.pid_exists(int(tags[TAG_PID]))


def close_orphaned_runs(name: str | None = None, params: Mapping[str, Any] | None = None,
                        experiment: str | None = None) -> list[str]:
    """Mark KILLED the RUNNING runs (all, or those named `name`) whose process died without ending them.

    A `kill -9` (or a lost machine) never runs `stage_run`'s finally, so its run would stay RUNNING
    forever and the MLflow UI would compare it as live. Called for all names at the start of every stage
    and flow run, and by `make ui`. Live runs (a concurrent sweep's) are left alone. Returns the ids closed.
    """
    if not enabled():
        return []
    client = _client()
    found = client.get_experiment_by_name(experiment or experiment_name(params))
    if found is None:
        return []
    query = "attributes.status = 'RUNNING'"
    if name is not None:
        query += " and attributes.run_name = '{}'".format(name.replace("'", "\\'"))
    closed = []
    for run in client.search_runs([found.experiment_id], query, max_results=1000):
        if _is_orphaned(run.data.tags):
            client.set_tag(run.info.run_id, "killed_reason", "its process died without ending the run")
            client.set_terminated(run.info.run_id, status="KILLED")
            closed.append(run.info.run_id)
    if closed:
        log.warning("tracking: marked %d orphaned RUNNING run(s)%s KILLED", len(closed),
                    f" of {name}" if name else "")
    return closed


def _end_status(error: BaseException | None) -> str:
    """How a run ends: FINISHED (no error, or exit code 0), KILLED (Ctrl-C), else FAILED."""
    if error is None or (isinstance(error, SystemExit) and error.code in (0, None)):
        return "FINISHED"
    return "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"


def _tracking_section(params: Mapping[str, Any] | None) -> Mapping[str, Any]:
    section = (params or {}).get("tracking") or {}
    return section if isinstance(section, Mapping) else {}


def _mlflow():
    import mlflow

    return mlflow


def _client():
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri())


def _guard(what: str, action, disable: bool = True):
    """Run an MLflow call; on failure warn in one line and return None.

    With `disable` (the default) this tracking URI is then skipped for the rest of the
    process, so a dead server costs one timeout, not one per call.
    """
    uri = tracking_uri()
    try:
        return action()
    except Exception as err:  # noqa: BLE001 - tracking must never fail a stage
        if uri not in _STATE.broken_uris:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            outcome = "continuing without MLflow" if disable else "continuing"
            log.warning("tracking: could not %s at %s (%s); %s", what, uri, first, outcome)
        if disable:
            _STATE.broken_uris.add(uri)
        return None


def _create_run(name: str, params: Mapping[str, Any] | None, tags: Mapping[str, str],
                parent_run_id: str | None, experiment: str | None = None) -> str | None:
    """Create a run (not active) under the experiment; None when tracking is off or unreachable."""
    if not enabled():
        return None
    for key, value in _HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    uri = tracking_uri(params)
    os.environ["MLFLOW_TRACKING_URI"] = uri  # so the Trainer's callback and child processes agree
    if not enabled():
        return None
    if uri.startswith(("http://", "https://")) and _guard("reach the server", lambda: _health(uri)) is None:
        return None
    experiment_id = _guard("open the experiment",
                           lambda: _experiment_id(experiment or experiment_name(params)))
    if experiment_id is None:
        return None
    # Every name, not only this run's: a killed stage whose outputs DVC then restores from its run cache
    # never starts a run of its own name again, and would stay RUNNING.
    _guard("close orphaned runs", lambda: close_orphaned_runs(None, params, experiment), disable=False)
    all_tags = {**dict(tags), **process_tags()}
    if parent_run_id and _guard("find parent run " + parent_run_id, lambda: _client().get_run(parent_run_id),
                                disable=False):
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = _guard("create the run", lambda: _client().create_run(experiment_id, run_name=name, tags=all_tags))
    if run is None:
        return None
    _log_params(run.info.run_id, params or {})
    return run.info.run_id


def _health(uri: str) -> bool:
    with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=5) as response:
        return response.status == 200


def _experiment_id(name: str) -> str:
    """The experiment's id, creating it (artifacts under <root>/mlartifacts for a local store)."""
    client = _client()
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = None
    if tracking_uri().startswith("sqlite:"):
        location = (project_root() / "mlartifacts" / name).as_uri()
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # another process created it between the two calls
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def _log_params(run_id: str, params: Mapping[str, Any]) -> None:
    from mlflow.entities import Param
    from mlflow.utils.validation import MAX_PARAMS_TAGS_PER_BATCH

    items = [Param(key, value) for key, value in flatten_params(params).items()]
    client = _client()
    for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
        chunk = items[start:start + MAX_PARAMS_TAGS_PER_BATCH]
        if _guard("log params", lambda chunk=chunk: client.log_batch(run_id, params=chunk) or True) is None:
            return


def _set_tags(run_id: str, tags: Mapping[str, str]) -> None:
    from mlflow.entities import RunTag

    _client().log_batch(run_id, tags=[RunTag(key, value) for key, value in tags.items()])


def _set_env(values: Mapping[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
