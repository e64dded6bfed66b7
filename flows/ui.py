"""`make ui`: the Prefect server, the MLflow server and the served deployments, on 127.0.0.1.

    python -m flows.ui        # Ctrl-C stops all three
    PARALLEL_R1_PREFECT_PORT=4300 PARALLEL_R1_MLFLOW_PORT=5100 python -m flows.ui

State stays in the project: Prefect in .prefect/ (PREFECT_HOME), MLflow runs in mlflow.db and
artifacts in mlartifacts/; server logs go to .prefect/logs/. Each child runs in its own process
group, so stopping (Ctrl-C, SIGTERM) terminates every process a server forked, then waits.
It prints both addresses and a link to the RL runs in MLflow (filter `tags.stage = 'rl'`; group
them by tag `reward_schedule` to compare schedules). Without these servers everything still
works: Prefect starts an ephemeral API per flow run and MLflow writes to mlflow.db directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from parallel_r1 import mlflow_ui, tracking
from parallel_r1.errors import PipelineError
from stages.common import load_params

HOST = "127.0.0.1"
PREFECT_PORT_ENV, MLFLOW_PORT_ENV = "PARALLEL_R1_PREFECT_PORT", mlflow_ui.PORT_ENV
DEFAULT_PREFECT_PORT, DEFAULT_MLFLOW_PORT = 4200, mlflow_ui.DEFAULT_PORT
START_TIMEOUT_S = 120.0


@dataclass
class Service:
    """A child process with where its health shows and where it logs."""

    name: str
    process: subprocess.Popen
    health_url: str | None
    log_path: Path | None


def prefect_server_command(port: int) -> list[str]:
    return [sys.executable, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(port),
            "--analytics-off"]


def prefect_server_env(root: Path, port: int) -> dict[str, str]:
    """The Prefect server's env. Its UI asks `/ui-settings` where the API is; Prefect answers
    PREFECT_UI_API_URL, else PREFECT_API_URL, else PREFECT_SERVER_API_PORT (default 4200) —
    never the `--port` it serves on — so the first and the last are set to `port` here."""
    return dict(server_env(root), PREFECT_SERVER_API_HOST=HOST, PREFECT_SERVER_API_PORT=str(port),
                PREFECT_UI_API_URL=f"http://{HOST}:{port}/api")


def mlflow_server_env(root: Path) -> dict[str, str]:
    """The MLflow server's env: its job runner (GenAI scoring, trace roll-ups; eight processes,
    ~0.5 GB) is switched off — this project logs runs and never submits server jobs."""
    return dict(server_env(root), MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")


def mlflow_server_command(port: int, root: Path) -> list[str]:
    return [sys.executable, "-m", "mlflow", "server", "--host", HOST, "--port", str(port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination", str(root / "mlartifacts")]


def server_env(root: Path, prefect_port: int | None = None, mlflow_port: int | None = None) -> dict[str, str]:
    """os.environ with the project's Prefect home and, when given, the two servers' addresses."""
    env = dict(os.environ, PREFECT_HOME=str(root / ".prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               DO_NOT_TRACK="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    if prefect_port:
        env["PREFECT_API_URL"] = f"http://{HOST}:{prefect_port}/api"
    if mlflow_port:
        env["MLFLOW_TRACKING_URI"] = f"http://{HOST}:{mlflow_port}"
    return env


def start(name: str, command: list[str], env: dict[str, str], cwd: Path, health_url: str | None = None,
          log_path: Path | None = None) -> Service:
    """Start `command` in a new process group; output to `log_path` (or inherited)."""
    output = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        output = open(log_path, "ab")  # noqa: SIM115 - the child owns it
    try:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=output,
                                   stderr=subprocess.STDOUT if output else None, start_new_session=True)
    finally:
        if output is not None:
            output.close()
    return Service(name, process, health_url, log_path)


def wait_healthy(service: Service, timeout: float = START_TIMEOUT_S) -> float:
    """Seconds until `service.health_url` answers 200; one-line error if it dies or times out."""
    assert service.health_url is not None, f"{service.name} has no health URL to wait on"
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if service.process.poll() is not None:
            raise PipelineError(f"{service.name} exited with {service.process.returncode} at start-up"
                                f" ({_last_line(service.log_path)})")
        try:
            with urllib.request.urlopen(service.health_url, timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.25)
    raise PipelineError(f"{service.name}: no answer at {service.health_url} within {timeout:.0f} s")


def stop(services: list[Service], timeout: float = 20.0) -> None:
    """Stop services in the given order: SIGTERM the process group, wait, SIGKILL what is left."""
    for service in services:
        _signal_group(service.process, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            service.process.wait(timeout=timeout)
        _signal_group(service.process, signal.SIGKILL)
        service.process.wait()


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
    return True


def close_orphaned_runs() -> None:
    """Runs left RUNNING by a killed process are marked KILLED, so the UI shows the truth."""
    try:
        closed = tracking.close_orphaned_runs()
    except Exception as err:  # noqa: BLE001 - a bad tracking store must not stop the servers
        print(f"warning: could not close orphaned MLflow runs ({str(err).splitlines()[0]})", file=sys.stderr)
        return
    if closed:
        print(f"MLflow: {len(closed)} run(s) left RUNNING by a killed process marked KILLED", flush=True)


def ui_addresses(root: Path, prefect_port: int, mlflow_port: int) -> str:
    """What `make ui` prints: both UIs and, once the experiment exists, its RL runs' table."""
    mlflow = f"http://{HOST}:{mlflow_port}"
    lines = [f"Prefect UI: http://{HOST}:{prefect_port}", f"MLflow UI:  {mlflow}"]
    try:
        experiment = tracking.experiment_name(load_params(root / "params.yaml"))
    except PipelineError:
        experiment = tracking.experiment_name()
    experiment_id = mlflow_experiment_id(mlflow, experiment)
    if experiment_id is None:
        lines.append(f"RL runs:    none yet in MLflow experiment {experiment!r}")
    else:
        lines.append(f"RL runs:    {mlflow_ui.runs_url(mlflow, experiment_id, mlflow_ui.RL_RUNS_FILTER)}"
                     "\n            (Group by -> reward_schedule puts the schedules side by side)")
    return "\n".join(lines)


def mlflow_experiment_id(server: str, name: str) -> str | None:
    """The id of experiment `name` on the MLflow server, None when there is none."""
    query = urllib.parse.urlencode({"experiment_name": name})
    url = f"{server}/api/2.0/mlflow/experiments/get-by-name?{query}"
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return json.load(answer)["experiment"]["experiment_id"]
    except OSError:  # 404: no such experiment
        return None


def main() -> None:
    root = Path.cwd()
    prefect_port = int(os.environ.get(PREFECT_PORT_ENV, DEFAULT_PREFECT_PORT))
    mlflow_port = int(os.environ.get(MLFLOW_PORT_ENV, DEFAULT_MLFLOW_PORT))
    for port, env_name in ((prefect_port, PREFECT_PORT_ENV), (mlflow_port, MLFLOW_PORT_ENV)):
        if not port_free(port):
            sys.exit(f"error: port {port} on {HOST} is in use (choose another with {env_name}=...)")
    # Ctrl-C and SIGTERM stop everything, even during start-up; SIGINT is set explicitly because a
    # process launched from a background job (`make ui &`, CI scripts) inherits it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    close_orphaned_runs()
    logs = root / ".prefect" / "logs"
    services: list[Service] = []
    interrupted = False
    try:
        launched = time.monotonic()
        services.append(start("Prefect server", prefect_server_command(prefect_port),
                              prefect_server_env(root, prefect_port), root,
                              f"http://{HOST}:{prefect_port}/api/health", logs / "prefect-server.log"))
        services.append(start("MLflow server", mlflow_server_command(mlflow_port, root),
                              mlflow_server_env(root), root, f"http://{HOST}:{mlflow_port}/health",
                              logs / "mlflow-server.log"))
        for service in services:  # both start at once: each line is its own start-up time
            wait_healthy(service)
            print(f"{service.name} healthy {time.monotonic() - launched:.1f} s after launch", flush=True)
        services.append(start("deployments", [sys.executable, "-m", "flows.serve"],
                              server_env(root, prefect_port, mlflow_port), root))
        print(f"{ui_addresses(root, prefect_port, mlflow_port)}\n"
              f"server logs: {logs}   Ctrl-C stops everything", flush=True)
        while not (exited := [service for service in services if service.process.poll() is not None]):
            time.sleep(0.5)
        print(f"error: {exited[0].name} exited with {exited[0].process.returncode}"
              f" ({_last_line(exited[0].log_path)})", file=sys.stderr)
    except KeyboardInterrupt:
        interrupted = True
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the clean-up short
            signal.signal(signum, signal.SIG_IGN)
        print("stopping ...", flush=True)
        stop(list(reversed(services)))
    sys.exit(0 if interrupted else 1)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


def _last_line(path: Path | None) -> str:
    if path is None or not path.is_file():
        return "see its output above"
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"{path} is empty"


if __name__ == "__main__":
    main()
