"""Prefect flows over DVC: stage plan and order, one completed task per stage, one-line stage
failures without retries, served deployments run through the API, sweeps as DVC experiments
with MLflow runs and a comparison table, and `make ui` stopping every process it started.

Server tests run `python -m flows.ui` (Prefect + MLflow servers on free loopback ports, the
deployments served) in a temporary copy of the project, and stop it at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
)
from prefect.client.schemas.objects import StateType
from prefect.deployments import run_deployment
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Failed

from flows import ui
from flows.dvc_runner import (
    DvcCommandError,
    TransientDvcError,
    error_from_output,
    experiment_metrics,
    plan_stages,
)
from flows.reproduce import reproduce, retry_only_transient
from flows.sweep import TABLE_KEY, plan_sweep, sweep
from parallel_r1.errors import PipelineError
from stages.profiles import write_params
from tests.conftest import fill_mirror

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def dvc(*args: str, cwd: Path) -> str:
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


def git_commit_all(root: Path) -> None:
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@localhost", "commit", "-qm",
                    "copy"], cwd=root, check=True)


def stage_block(dvc_yaml: str, name: str) -> str:
    """The text of one stage of dvc.yaml (so a stage elsewhere in the file can't break the copy)."""
    lines = dvc_yaml.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith(f"  {name}:"))
    block = [lines[start]]
    for line in lines[start + 1:]:
        if line.strip() and not line.startswith("    "):
            break
        block.append(line)
    return "\n".join(block).rstrip() + "\n"


@pytest.fixture(scope="module")
def project(tmp_path_factory, mirror) -> Path:
    """A committed copy of the project whose dvc.yaml holds its real `prepare_data` stage."""
    root = tmp_path_factory.mktemp("project")
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout.splitlines()
    for name in listed:
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    (root / "dvc.yaml").write_text("stages:\n" + stage_block((REPO / "dvc.yaml").read_text(), "prepare_data"))
    fill_mirror(root, mirror)   # its git-ignored mirror/, as `make data` fills it: a sweep copies it (--temp)
    write_params(root)
    git_commit_all(root)
    return root


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    """A DVC project of four tiny stages: a -> b -> tracked (param x; logs to MLflow), and broken."""
    root = tmp_path_factory.mktemp("toy")
    write = "import sys; open(sys.argv[2], 'w').write(open(sys.argv[1]).read() + sys.argv[2])"
    (root / "write.py").write_text(write + "\n")
    (root / "tracked_stage.py").write_text(
        "from parallel_r1 import tracking\n"
        "params = {'profile': 'tiny', 'tracking': {'experiment': 'toy'}, 'x': {'y': 1}}\n"
        "with tracking.stage_run('tracked', 'toy', params, {'variant': 'seen'}):\n"
        "    tracking.log_metrics({'score': 0.5}, step=1)\n"
        "open('c.txt', 'w').write('c')\n"
        "open('score.json', 'w').write('{\"score\": 0.5}')\n")
    (root / "seed.txt").write_text("0")
    stages = {
        "a": {"cmd": "python write.py seed.txt a.txt", "deps": ["seed.txt"], "outs": ["a.txt"]},
        "b": {"cmd": "python write.py a.txt b.txt", "deps": ["a.txt"], "outs": ["b.txt"]},
        "tracked": {"cmd": "python tracked_stage.py", "deps": ["b.txt", "tracked_stage.py"], "params": ["x"],
                    "outs": ["c.txt"],
                    "metrics": [{"score.json": {"cache": False}}]},
        "broken": {"cmd": "python -c \"import sys; print('error: params.yaml broken.x: must be positive',"
                          " file=sys.stderr); sys.exit(1)\""},
    }
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    (root / "params.yaml").write_text("profile: tiny\nx: 0\ntracking: {experiment: toy}\n")
    git_commit_all(root)
    dvc("init", "-q", cwd=root)
    return root


@pytest.fixture(scope="module")
def ui_stack(project):
    """`python -m flows.ui` in the project copy: Prefect and MLflow servers plus served deployments."""
    ports = {"prefect": free_port(), "mlflow": free_port()}
    env = dict(os.environ, PARALLEL_R1_PREFECT_PORT=str(ports["prefect"]),
               PARALLEL_R1_MLFLOW_PORT=str(ports["mlflow"]), PYTHONPATH=str(project))
    log = open(project / "ui.log", "wb")  # noqa: SIM115
    process = subprocess.Popen([sys.executable, "-m", "flows.ui"], cwd=project, env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    stack = {"process": process, "prefect": f"http://127.0.0.1:{ports['prefect']}",
             "mlflow": f"http://127.0.0.1:{ports['mlflow']}", "log": project / "ui.log"}
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "MLflow UI" not in stack["log"].read_text(errors="replace"):
            assert process.poll() is None, stack["log"].read_text(errors="replace")[-2000:]
            assert time.monotonic() < deadline, "flows.ui did not start in time"
            time.sleep(1)
        yield stack
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        log.close()


@pytest.fixture
def prefect_api(ui_stack, monkeypatch):
    """In-process flows and clients talk to the test's Prefect server, MLflow to its MLflow server."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", ui_stack["mlflow"])
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    with temporary_settings(updates={PREFECT_API_URL: f"{ui_stack['prefect']}/api"}):
        yield ui_stack


def task_runs(flow_run_id) -> list:
    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def test_plan_follows_dvc_dependency_order(toy):
    assert plan_stages(["tracked"], toy) == ["a", "b", "tracked"]
    assert plan_stages(["b.txt"], toy) == ["a", "b"]
    assert set(plan_stages([], toy)) == {"a", "b", "tracked", "broken"}
    with pytest.raises(PipelineError, match=r"^dvc.yaml: cannot plan targets \['nope'\]") as err:
        plan_stages(["nope"], toy)
    assert "\n" not in str(err.value)


def test_error_line_prefers_the_stage_error_and_only_contention_or_a_shortage_is_transient():
    stage_failure = ["Running stage 'filter':", "> python -m stages.filter",
                     "error: data/teacher/gsm8k.jsonl line 3: missing field 'completion'",
                     "ERROR: failed to reproduce 'filter': failed to run: python -m stages.filter, "
                     "exited with 1"]
    err = error_from_output(stage_failure, "dvc repro")
    assert type(err) is DvcCommandError and str(err) == stage_failure[2]
    lock = error_from_output(["ERROR: Unable to acquire lock. Most likely another DVC process is running"],
                             "dvc")
    assert isinstance(lock, TransientDvcError)
    assert retry_only_transient(None, None, Failed(data=lock))
    assert not retry_only_transient(None, None, Failed(data=err))
    from parallel_r1.errors import ResourceShortage

    short = [f"error: {ResourceShortage('params.yaml generate.gpu_memory_utilization: 5 GiB free')}",
             "ERROR: failed to reproduce 'generate@dapo': failed to run: python -m stages.generate dapo"]
    shortage = error_from_output(short, "dvc repro")
    assert isinstance(shortage, TransientDvcError) and str(shortage) == short[0]


def test_sweep_plan_sets_reward_seed_and_profile_params_per_combination():
    plan = plan_sweep(["parallel_r1_unseen_s2"], ["accuracy", "alternating"], [1, 2], "tiny", None, {}, "sw")
    assert len(plan) == 4 and len({experiment.name for experiment in plan}) == 4
    assert plan[1].target == "rl@parallel_r1_unseen_s2"
    assert plan[1].overrides == ("profile=tiny", "rl_runs.parallel_r1_unseen_s2.reward=accuracy", "seed=2")
    assert plan[1].labels == {"profile": "tiny", "configuration": "parallel_r1_unseen_s2",
                              "reward_schedule": "accuracy", "seed": "2"}
    grid = plan_sweep([], [], [], "paper", "prepare_data", {"data.eval.aime24.limit": ["1", "2"]}, "sw")
    assert [experiment.overrides for experiment in grid] == [("profile=paper", "data.eval.aime24.limit=1"),
                                                             ("profile=paper", "data.eval.aime24.limit=2")]
    with pytest.raises(PipelineError, match="reward_schedules need configurations"):
        plan_sweep([], ["accuracy"], [], "tiny", "prepare_data", {}, "sw")


def test_experiment_metrics_are_read_from_dvc_exp_show():
    show = [{"rev": "abc", "experiments": [{"name": "e1", "revs": [{"name": "e1", "data": {"metrics": {
        "metrics/rl/a/summary.json": {"data": {"reward": 0.5, "acc": {"final": 0.25}, "note": "x"}},
        "metrics/missing.json": {"error": {"type": "FileNotFoundError"}}}}}]}]}]
    assert experiment_metrics(show, ["e1", "e2"]) == {"e1": {"reward": 0.5, "acc.final": 0.25}}


@pytest.mark.server
@pytest.mark.slow
def test_reproduce_runs_each_stage_as_a_completed_task_and_nests_stage_runs(toy, prefect_api, monkeypatch):
    monkeypatch.chdir(toy)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    state = reproduce(targets=["tracked"], return_state=True)
    assert state.is_completed(), state.message
    assert state.result() == {"a": "ran", "b": "ran", "tracked": "ran"}
    runs = task_runs(state.state_details.flow_run_id)
    assert sorted((run.name, run.state.type) for run in runs) == [
        ("a", StateType.COMPLETED), ("b", StateType.COMPLETED), ("tracked", StateType.COMPLETED)]
    client = MlflowClient(prefect_api["mlflow"])
    stage_run = client.search_runs([client.get_experiment_by_name("toy").experiment_id],
                                   filter_string="tags.stage = 'tracked'")[0]
    parent = client.get_run(stage_run.data.tags["mlflow.parentRunId"])
    assert parent.info.run_name == "reproduce@tracked"
    assert parent.data.tags["prefect_flow_run_id"] == str(state.state_details.flow_run_id)
    assert stage_run.data.params["x.y"] == "1" and stage_run.data.tags["dvc_stage"] == "tracked"
    assert "| `tracked@toy` | FINISHED |" in (toy / "reports" / "run_summary.md").read_text()
    again = reproduce(targets=["tracked"])
    assert again == {"a": "up to date", "b": "up to date", "tracked": "up to date"}


@pytest.mark.parametrize("port, shell_api_url", [(4301, None), (4200, "http://127.0.0.1:4301/api")])
def test_prefect_server_tells_its_ui_the_api_on_the_port_it_serves(port, shell_api_url, tmp_path,
                                                                   monkeypatch):
    """The UI asks the server's /ui-settings where the API is; Prefect answers PREFECT_UI_API_URL."""
    if shell_api_url:  # e.g. left in the user's shell by an earlier `make ui` on another port
        monkeypatch.setenv("PREFECT_API_URL", shell_api_url)
    else:
        monkeypatch.delenv("PREFECT_API_URL", raising=False)
    code = "import prefect.settings as s; print(s.PREFECT_UI_API_URL.value())"
    shown = subprocess.run([sys.executable, "-c", code], env=ui.prefect_server_env(tmp_path, port),
                           check=True, capture_output=True, text=True).stdout.strip()
    assert shown == f"http://127.0.0.1:{port}/api"


@pytest.mark.slow
def test_make_run_with_no_prefect_server_nests_the_stage_runs_under_one_parent_run(toy, tmp_path):
    """`make run`'s command with no PREFECT_API_URL: a temporary local Prefect server, one `dvc repro`, its
    stages' MLflow runs under the flow's parent run."""
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    env.update(MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}",
               PREFECT_HOME=str(tmp_path / "prefect"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "flows.reproduce", "--force", "tracked"], cwd=toy, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Running stage 'tracked'" in done.stdout + done.stderr  # DVC's output, in the stage's task log
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("toy").experiment_id
    (parent,) = client.search_runs([experiment], filter_string="tags.flow = 'reproduce'")
    assert (parent.info.run_name, parent.info.status) == ("reproduce@tracked", "FINISHED")
    stage_runs = client.search_runs([experiment], filter_string="tags.stage = 'tracked'")
    assert [run.data.tags["mlflow.parentRunId"] for run in stage_runs] == [parent.info.run_id]
    summary = (toy / "reports" / "run_summary.md").read_text()  # the run reports itself
    assert "`reproduce@tracked`, profile `tiny`" in summary and "| `tracked@toy` | FINISHED |" in summary


@pytest.mark.server
@pytest.mark.slow
def test_sweep_experiment_runs_nest_their_stage_runs_and_table_holds_dvc_metrics(toy, prefect_api,
                                                                                  monkeypatch):
    monkeypatch.chdir(toy)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    (row,) = sweep(configurations=[], target="tracked", grid={"x": ["1"]})
    assert (row["state"], row["score"]) == ("success", 0.5)
    client = MlflowClient(prefect_api["mlflow"])
    query = f"tags.dvc_exp_name = '{row['experiment']}' and tags.stage = 'tracked'"
    (stage_run,) = client.search_runs([client.get_experiment_by_name("toy").experiment_id],
                                      filter_string=query)
    assert stage_run.data.tags["mlflow.parentRunId"] == row["mlflow_run_id"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=toy, capture_output=True,
                          text=True).stdout.strip()
    assert stage_run.data.tags["git_commit"] == head  # DVC_ROOT: the project, not the temporary clone
    assert client.get_run(row["mlflow_run_id"]).data.metrics["score"] == 0.5


@pytest.mark.server
@pytest.mark.slow
def test_failing_stage_fails_the_flow_with_its_error_line_and_no_retry(toy, prefect_api, monkeypatch):
    monkeypatch.chdir(toy)
    state = reproduce(targets=["broken"], return_state=True)
    assert state.is_failed()
    with pytest.raises(DvcCommandError) as err:
        state.result()
    assert str(err.value) == "stage broken: error: params.yaml broken.x: must be positive"
    (run,) = task_runs(state.state_details.flow_run_id)
    assert run.state.type == StateType.FAILED and run.run_count == 1


@pytest.mark.server
@pytest.mark.slow
def test_served_deployments_are_listed_and_a_triggered_run_completes(prefect_api):
    wanted, names = {"reproduce/parallel-r1", "sweep/parallel-r1"}, set()
    deadline = time.monotonic() + START_TIMEOUT_S  # `flows.serve` registers them after the servers are up
    while not wanted <= names and time.monotonic() < deadline:
        time.sleep(1)
        with get_client(sync_client=True) as client:
            names = {client.read_flow(deployment.flow_id).name + "/" + deployment.name
                     for deployment in client.read_deployments()}
    assert wanted <= names
    flow_run = run_deployment("reproduce/parallel-r1", parameters={"targets": ["prepare_data"]}, timeout=600,
                              poll_interval=2, as_subflow=False)
    assert flow_run.state.type == StateType.COMPLETED, flow_run.state.message
    assert ([(run.name, run.state.type) for run in task_runs(flow_run.id)]
            == [("prepare_data", StateType.COMPLETED)])


def test_a_run_marked_crashed_while_the_server_heard_nothing_is_waited_for_while_it_sends_heartbeats(
        prefect_api):
    """A Prefect server down for longer than the heartbeat window gets every running run marked Crashed by the
    heartbeat automation; relaunching them duplicated live experiments. On this server's own events:
    marked and silent since is "unknown" until RECHECK_S, then "dead" (relaunch); a heartbeat after the
    marking makes it "alive" (wait for its own end) until its heartbeats stop again; a crash its worker
    reported is "dead" at once."""
    from datetime import timedelta
    from uuid import uuid4

    from prefect import flow
    from prefect.events import Event
    from prefect.states import Crashed, Running

    from flows.workpool import RECHECK_S, SILENCE_MESSAGE, SILENCE_S, last_heartbeat, liveness

    @flow(name="liveness-probe")
    def probe() -> None:
        """Never run: its flow run only carries states."""

    with get_client(sync_client=True) as client:
        created = client.create_flow_run(probe, name="alive-after-an-outage")
        client.set_flow_run_state(created.id, Running(), force=True)
        client.set_flow_run_state(created.id, Crashed(message=SILENCE_MESSAGE.format(silence_s=SILENCE_S)),
                                  force=True)
        run = client.read_flow_run(created.id)
    marked = run.state.timestamp
    assert liveness(run, now=marked + timedelta(seconds=1)) == "unknown"
    assert liveness(run, now=marked + timedelta(seconds=RECHECK_S + 1)) == "dead"
    heartbeat = Event(event="prefect.flow-run.heartbeat", occurred=marked + timedelta(seconds=2), id=uuid4(),
                      resource={"prefect.resource.id": f"prefect.flow-run.{run.id}"})
    with get_client(sync_client=True) as client:
        client.request("POST", "/events", json=[heartbeat.model_dump(mode="json")]).raise_for_status()
    deadline = time.monotonic() + 60   # the server's event persister stores it within seconds
    while (beat := last_heartbeat(run.id, marked)) is None:
        assert time.monotonic() < deadline, "the heartbeat never reached the server's events"
        time.sleep(1)
    assert liveness(run, now=beat + timedelta(seconds=5)) == "alive"
    assert liveness(run, now=beat + timedelta(seconds=SILENCE_S + 1)) == "dead"   # stopped again: relaunch
    reported = run.state.model_copy(update={"message": "Flow run infrastructure exited with non-zero status"
                                                       " code -9."})
    assert liveness(run.model_copy(update={"state": reported}), now=marked) == "dead"


@pytest.mark.server
@pytest.mark.slow
def test_sweep_of_two_configurations_gives_two_experiments_two_runs_and_a_table(project, prefect_api,
                                                                                monkeypatch):
    monkeypatch.chdir(project)
    state = sweep(configurations=[], target="prepare_data", grid={"data.eval.aime24.limit": ["1", "2"]},
                  return_state=True)
    assert state.is_completed(), state.message
    rows = state.result()
    names = [row["experiment"] for row in rows]
    assert len(names) == 2 and all(row["state"] == "success" for row in rows)
    shown = json.loads(dvc("exp", "show", "--json", cwd=project))
    experiments = {rev["name"]:
                   rev["data"]["params"]["params.yaml"]["data"]["data"]["eval"]["aime24"]["limit"]
                   for baseline in shown for exp in baseline.get("experiments") or [] for rev in exp["revs"]}
    assert {name: experiments[name] for name in names} == {names[0]: 1, names[1]: 2}
    client = MlflowClient(prefect_api["mlflow"])
    experiment_id = client.get_experiment_by_name("parallel-r1").experiment_id
    found = client.search_runs([experiment_id],
                               filter_string=f"tags.sweep_id = '{names[0].rsplit('-', 1)[0]}'")
    (sweep_run,) = [run for run in found if "dvc_exp_name" not in run.data.tags]
    runs = {run.data.tags["dvc_exp_name"]: run for run in found if "dvc_exp_name" in run.data.tags}
    assert sorted(runs) == sorted(names) and sweep_run.data.tags["flow"] == "sweep"
    assert {run.data.tags["mlflow.parentRunId"] for run in runs.values()} == {sweep_run.info.run_id}
    assert runs[names[1]].data.params["data.eval.aime24.limit"] == "2"
    with get_client(sync_client=True) as prefect:
        artifacts = prefect.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    table = next(artifact for artifact in artifacts if artifact.key == TABLE_KEY)
    data = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert [row["experiment"] for row in data] == names
    link = next(artifact for artifact in artifacts if artifact.key != TABLE_KEY)
    assert f"{prefect_api['mlflow']}/#/experiments/{experiment_id}/runs/" in link.data


@pytest.mark.server
@pytest.mark.slow
def test_ui_stops_every_process_it_started_on_sigint(ui_stack):
    """Runs last in this module: it stops the stack the other server tests share."""
    leader = psutil.Process(ui_stack["process"].pid)
    started = [leader, *leader.children(recursive=True)]
    assert len(started) >= 4  # flows.ui, Prefect server, MLflow server (+ its uvicorn), deployments
    for url in (f"{ui_stack['prefect']}/api/health", f"{ui_stack['mlflow']}/health"):
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
    os.killpg(leader.pid, signal.SIGINT)
    assert ui_stack["process"].wait(timeout=120) == 0
    gone, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, [process.cmdline() for process in alive]
    for url in (ui_stack["prefect"], ui_stack["mlflow"]):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=5)


def test_sweep_ids_carry_the_year_and_differ_within_one_second():
    """Two clones starting sweeps in the same second must not share refs/sweeps/<id> on the git remote."""
    import re

    from flows.remote import unique_id

    ids = {unique_id("sweep") for _ in range(50)}
    assert len(ids) == 50
    assert all(re.fullmatch(r"sweep-20\d{6}-\d{6}-[0-9a-f]{6}", sweep_id) for sweep_id in ids), ids
