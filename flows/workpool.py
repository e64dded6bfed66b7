"""The work pool a sweep fans out to: its `experiment` deployment, its workers, launching and waiting.

    python -m flows.workpool worker --pool parallel-r1       # what `make worker` runs, in any clone
    python -m flows.workpool timeline <sweep id>             # which worker ran which experiment, when
    python -m flows.workpool timeline <reproduce id>         # the same for a fanned-out reproduce

A pool is Prefect's: `process` type when this module creates it (each flow run a subprocess of a
worker); create it as `kubernetes` or `docker` beforehand (`prefect work-pool create --type ...`) and
the same deployment runs there — the code does not change, only the pool. The deployment
`experiment/<pool>` (flows/experiment.py) carries one pull step, `set_working_directory` to
`{{ $PARALLEL_R1_CLONE }}`: each worker exports its own clone's path (`start_worker` does), so one
deployment serves clones at different paths on different machines. Both the sweep and each worker
register the pool and the deployment (idempotent), so neither has to come first.

A run whose worker dies is marked Crashed by the server (heartbeats + an automation, `ensure_crash_
automation`); the sweep then launches it again (flows/sweep.py), and no other run is touched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from parallel_r1.errors import RESOURCE_MARK, PipelineError

DEFAULT_POOL = "parallel-r1"
CLONE_ENV = "PARALLEL_R1_CLONE"
# flow name -> entrypoint (path:function from the clone's root), each deployed as <flow>/<pool>
ENTRYPOINTS = {"experiment": "flows/experiment.py:experiment", "pool-stage": "flows/pool_stage.py:pool_stage"}
SWEEP_TAG = "sweep:{sweep_id}"
POLL_S = 2.0
# A flow run whose machine dies (a killed worker, a lost node) stays Running: nothing is left to report
# its end. Workers make their flow runs send a heartbeat event every HEARTBEAT_S seconds (Prefect's
# minimum is 30), and an automation marks a run Crashed when none came for SILENCE_S seconds.
HEARTBEAT_S = 30
SILENCE_S = 75
CRASH_AUTOMATION = "parallel-r1: crash flow runs whose heartbeat stopped"
SILENCE_MARK = "no heartbeat for"   # how the automation's Crashed states begin (`liveness` reads it)
SILENCE_MESSAGE = SILENCE_MARK + " {silence_s} s: its worker died"
# The automation cannot tell a dead worker from a server that was down (or unreachable) for SILENCE_S: both
# stop the heartbeats it sees. A run it marked Crashed is relaunched only once no heartbeat came for
# RECHECK_S after the marking; a live run's next one comes within HEARTBEAT_S once the server is back.
RECHECK_S = HEARTBEAT_S + 15
WORKER_LABEL = "prefect.worker.name"  # the label a Prefect worker gives each flow run it takes


def check_shared_services(what: str) -> None:
    """Work on a pool is seen by other machines: the Prefect API and MLflow must be servers they reach,
    not this process's temporary API nor a local MLflow file. One line says which is not."""
    from prefect.settings import PREFECT_API_URL

    from parallel_r1 import tracking

    if not PREFECT_API_URL.value():
        raise PipelineError(f"{what}: PREFECT_API_URL is not set; point it at the Prefect server the workers"
                            " use (e.g. http://<host>:4200/api)")
    uri = tracking.tracking_uri()
    if tracking.enabled() and not uri.startswith(("http://", "https://")):
        raise PipelineError(f"{what}: MLFLOW_TRACKING_URI is {uri}, this machine's own store; set it to"
                            " the MLflow server the workers use (http://<host>:5000),"
                            " or PARALLEL_R1_TRACKING=off")


def register(pool: str) -> None:
    """Create the pool (process type) when missing and (re)write its deployments (`ENTRYPOINTS`)."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.utilities.callables import parameter_schema
    from prefect.workers.process import ProcessWorker

    from flows.experiment import experiment
    from flows.pool_stage import pool_stage

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            template = ProcessWorker.get_default_base_job_template()
            with contextlib.suppress(ObjectAlreadyExists):  # another worker or sweep created it meanwhile
                client.create_work_pool(WorkPoolCreate(name=pool, type="process", base_job_template=template))
        for flow in (experiment, pool_stage):
            client.create_deployment(
                flow_id=client.create_flow_from_name(flow.name), name=pool, work_pool_name=pool,
                entrypoint=ENTRYPOINTS[flow.name], tags=["parallel-r1"],
                description=(flow.description or "").split("\n")[0],
                parameter_openapi_schema=parameter_schema(flow).model_dump_for_openapi(),
                pull_steps=[{"prefect.deployments.steps.set_working_directory":
                             {"directory": "{{ $" + CLONE_ENV + " }}"}}])


def ensure_crash_automation(silence_s: int = SILENCE_S) -> None:
    """Create (once per server) the automation that marks a flow run Crashed when its heartbeats stop
    for `silence_s` seconds: Prefect's recipe for runs whose infrastructure died (detect-zombie-flows)."""
    from datetime import timedelta

    from prefect import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    with get_client(sync_client=True) as client:
        if client.read_automations_by_name(name=CRASH_AUTOMATION):
            return
        finals = {f"prefect.flow-run.{name}" for name in ("Completed", "Failed", "Cancelled", "Crashed")}
        client.create_automation(AutomationCore(
            name=CRASH_AUTOMATION, description="a worker or its machine died: its flow run is marked Crashed",
            trigger=EventTrigger(
                after={"prefect.flow-run.heartbeat"}, expect={"prefect.flow-run.heartbeat", *finals},
                match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
                for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
                within=timedelta(seconds=silence_s)),
            actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                        message=SILENCE_MESSAGE.format(silence_s=silence_s))]))


def last_heartbeat(flow_run_id, since):
    """When flow run `flow_run_id` last sent a heartbeat event at or after `since` (UTC), as the server has
    them; None if none came."""
    from prefect import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

    with get_client(sync_client=True) as client:
        page = client.read_events(filter=EventFilter(
            occurred=EventOccurredFilter(since=since),
            event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
            resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run_id}"])), limit=1)
    return max((event.occurred for event in page.events), default=None)


def liveness(run, now=None) -> str:
    """Whether a Crashed run is "dead" (relaunch it), "alive" (the heartbeat automation marked it while the
    server heard nothing, e.g. during an outage, and it has sent heartbeats since: wait for its own end) or
    "unknown" (marked less than RECHECK_S ago, nothing since). A crash its worker reported (the process
    exited) is dead at once; so is a marked run whose heartbeats stopped again for SILENCE_S."""
    from datetime import datetime, timezone

    import httpx

    if not (run.state.message or "").startswith(SILENCE_MARK):
        return "dead"
    now = now or datetime.now(timezone.utc)
    marked = run.state.timestamp
    try:
        last = last_heartbeat(run.id, marked)
    except (OSError, httpx.HTTPError):   # the server unreachable again: no news, as if none came
        last = None
    if last is not None and (now - last).total_seconds() <= SILENCE_S:
        return "alive"
    return "unknown" if last is None and (now - marked).total_seconds() < RECHECK_S else "dead"


def launch(pool: str, flow_name: str, runs: list[dict[str, Any]], names: list[str], tag: str) -> list:
    """One flow run of `<flow_name>/<pool>` per parameter dict, named by `names`; returns them at once.

    Called inside a flow (sweep, reproduce), so each shows in the UI as a subflow run of it.
    """
    from prefect.deployments import run_deployment

    register(pool)
    return [run_deployment(f"{flow_name}/{pool}", parameters=parameters, flow_run_name=name, timeout=0,
                           tags=["parallel-r1", tag])
            for parameters, name in zip(runs, names, strict=True)]


def poll(flow_run_ids: list) -> list:
    """The flow runs' current records (state, start, end), read once."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=flow_run_ids)))


def wait(flow_run_ids: list, echo=print, poll_s: float = POLL_S, on_final=None) -> dict:
    """Poll the API until every flow run is in a final state; returns {id: FlowRun}.

    `on_final(run)`, called when a run is seen in a final state, may return a flow run to wait for as well:
    a relaunch, or the same run to look at again (one marked Crashed that may still be alive); each state
    change is echoed.
    """
    reported: dict[Any, str]
    waiting, done, reported = list(flow_run_ids), {}, {}
    while waiting:
        for run in poll(waiting):
            state = run.state.type.value if run.state else "UNKNOWN"
            if reported.get(run.id) != state:
                reported[run.id] = state
                echo(f"{run.name}: {state}")
            if run.state and run.state.is_final():
                waiting.remove(run.id)
                done[run.id] = run
                again = on_final(run) if on_final else None
                if again is not None:
                    waiting.append(again.id)
        if waiting:
            time.sleep(poll_s)
    return done


def worth_another_attempt(state) -> bool:
    """A final state a new attempt may turn out otherwise: Crashed, or Failed on a ResourceShortage."""
    kind = state.type.value
    return kind == "CRASHED" or (kind == "FAILED" and RESOURCE_MARK in (state.message or ""))


def run_all(pool: str, flow_name: str, params: dict[str, dict[str, Any]], tag: str, crash_retries: int,
            echo=print) -> tuple[dict, dict[str, int]]:
    """Launch one `flow_name` run per entry of `params` (name -> parameters) and wait for all. A run that
    Crashed (its worker died) or Failed for want of a resource (a `ResourceShortage`: too little free memory
    on its worker just then) is launched again at once, up to `crash_retries` times; one that Failed on its
    own error is not, nor one marked Crashed for silence that sends heartbeats again (`liveness`).
    Returns ({name: its last attempt's flow run}, {name: attempts})."""
    attempts = dict.fromkeys(params, 1)
    alive_said: set = set()

    def relaunch_crashed(run):
        if run.state.type.value == "CRASHED" and (alive := liveness(run)) != "dead":
            if alive == "alive" and run.id not in alive_said:
                alive_said.add(run.id)
                echo(f"{run.name} was marked crashed ({run.state.message}) but still sends heartbeats:"
                     " the server lost them for a while; waiting for it, not launching it again")
            return run  # polled again: its own end, or dead once its heartbeats stop
        if not worth_another_attempt(run.state) or attempts[run.name] > crash_retries:
            return None
        attempts[run.name] += 1
        why = "crashed" if run.state.type.value == "CRASHED" else "failed for want of a resource"
        echo(f"{run.name} {why} ({run.state.message}): launching it again")
        (again,) = launch(pool, flow_name, [params[run.name]], [run.name], tag)
        latest[run.name] = again.id
        return again

    launched = launch(pool, flow_name, list(params.values()), list(params), tag)
    latest = {run.name: run.id for run in launched}
    runs = wait(list(latest.values()), echo=echo, on_final=relaunch_crashed)
    return {name: runs[run_id] for name, run_id in latest.items()}, attempts


def results(flow_run_ids: list, key: str = "experiment-result") -> dict:
    """{flow run id: the row its result artifact (`key`) holds}."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=flow_run_ids), key=ArtifactFilterKey(any_=[key])))
    found = {}
    for artifact in artifacts:
        data = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
        if data:
            found[artifact.flow_run_id] = data[0]
    return found


def timeline(tag: str, key: str = "experiment-result") -> list[dict[str, str]]:
    """The flow runs tagged `tag` (`sweep:<id>`, `reproduce:<id>`) as the API has them: name, worker, state,
    start, end (UTC), by start time (`timeline_row`)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])))
    rows_by_id = results([run.id for run in runs], key) if runs else {}
    return [timeline_row(run, rows_by_id.get(run.id))
            for run in sorted(runs, key=lambda run: (run.start_time is None, run.start_time or 0, run.name))]


def timeline_row(run, result: dict | None) -> dict[str, str]:
    """One flow run of a timeline. Its worker is the one its result row names; a run that failed or crashed
    has no row, so the worker is the label Prefect's worker gives each run it takes (`WORKER_LABEL`)."""
    worker = (result or {}).get("worker") or (getattr(run, "labels", None) or {}).get(WORKER_LABEL, "")
    return {"name": run.name, "worker": str(worker), "state": run.state.type.value if run.state else "",
            "start": run.start_time.isoformat(timespec="seconds") if run.start_time else "",
            "end": run.end_time.isoformat(timespec="seconds") if run.end_time else ""}


def timeline_query(run_id: str) -> tuple[str, str]:
    """(tag, result key) of the flow runs of `run_id`, as a sweep (`sweep-...`, its experiments) or a
    fanned-out reproduce (`reproduce-...`, its stages) tags them and names their result artifacts."""
    kind = run_id.split("-", 1)[0]
    if kind == "reproduce":
        return f"reproduce:{run_id}", "stage-result"
    return SWEEP_TAG.format(sweep_id=run_id), "experiment-result"


def api_url() -> str:
    """The Prefect API this process talks to, for messages: PREFECT_API_URL, or the temporary local one."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or "the temporary local Prefect API (PREFECT_API_URL is not set)"


def format_timeline(rows: list[dict[str, str]]) -> list[str]:
    """The timeline as aligned text under a header: each column as wide as its longest entry, so long
    experiment or worker names do not push the columns after them out of line."""
    columns = ("name", "worker", "state", "start", "end")
    widths = {column: max([len(column), *(len(row[column]) for row in rows)]) for column in columns}
    lines = [{column: column for column in columns}, *rows]
    return ["  ".join(f"{line[column]:<{widths[column]}}" for column in columns).rstrip() for line in lines]


def worker_command(pool: str, limit: int, name: str) -> list[str]:
    """`prefect worker start` for the pool, as `make worker` runs it."""
    return [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process",
            "--limit", str(limit), "--name", name]


def start_worker(pool: str, limit: int, root: Path) -> None:
    """Register the pool and deployment, then become a worker of it, serving this clone."""
    check_shared_services("worker")
    register(pool)
    ensure_crash_automation()
    name = f"{socket.gethostname()}-{root.name}"
    os.environ[CLONE_ENV] = str(root)
    os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(HEARTBEAT_S))  # inherited by each flow run
    print(f"worker {name} of pool {pool!r} (at most {limit} experiment(s) at a time)", flush=True)
    os.execv(sys.executable, worker_command(pool, limit, name))


def main() -> None:
    parser = argparse.ArgumentParser(description="the sweep work pool: a worker, or a sweep's timeline")
    commands = parser.add_subparsers(dest="command", required=True)
    worker = commands.add_parser("worker", help="serve this clone as a worker of the pool")
    worker.add_argument("--pool", default=os.environ.get("PARALLEL_R1_POOL", DEFAULT_POOL))
    worker.add_argument("--limit", type=int, default=1, help="experiments at a time on this machine")
    show = commands.add_parser("timeline", help="which worker ran which experiment of a sweep, and when")
    show.add_argument("run_id", help="a sweep id (sweep-...) or a fanned-out reproduce's id (reproduce-...)")
    args = parser.parse_args()
    try:
        if args.command == "worker":
            start_worker(args.pool, args.limit, Path.cwd().resolve())
        else:
            tag, key = timeline_query(args.run_id)
            if not (rows := timeline(tag, key)):
                raise PipelineError(f"no flow runs tagged {tag!r} on {api_url()}: the id the sweep or"
                                    " `make run POOL=...` logged first, on the server its workers use?")
            print("\n".join(format_timeline(rows)))
    except PipelineError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
