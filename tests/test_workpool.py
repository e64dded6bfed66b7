"""The pieces of the work pool that need no server: the stage graph a fan-out schedules from, the commit a
pool runs (pushed, or refused with one line), and the private clone a worker runs it in."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from flows.dvc_runner import DvcCommandError, plan_graph, workspace_metrics
from flows.remote import SWEEP_REF_PREFIX, private_clone, push_baseline, push_experiment, stage_outs
from parallel_r1.errors import PipelineError

GIT = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost"]


def run(*args: str, cwd: Path) -> str:
    return subprocess.run(args, cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def diamond(tmp_path) -> Path:
    """A committed DVC project a -> (b, c) -> d, with a filesystem remote beside it and a bare git remote."""
    root = tmp_path / "project"
    root.mkdir()
    stages = {"a": {"cmd": "echo a > a.txt && echo '{\"size\": {\"a\": 1.5}, \"n\": 2}' > score.json",
                    "outs": ["a.txt"], "metrics": [{"score.json": {"cache": False}}]},
              "b": {"cmd": "cat a.txt > b.txt", "deps": ["a.txt"], "outs": ["b.txt"]},
              "c": {"cmd": "cat a.txt > c.txt", "deps": ["a.txt"], "outs": ["c.txt"]},
              "d": {"cmd": "cat b.txt c.txt > d.txt", "deps": ["b.txt", "c.txt"], "outs": ["d.txt"]}}
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    run("git", "init", "-q", cwd=root)
    run(sys.executable, "-m", "dvc", "init", "-q", cwd=root)
    run(sys.executable, "-m", "dvc", "remote", "add", "-d", "storage", "../dvc-remote", cwd=root)
    run(*GIT, "add", "-A", cwd=root)
    run(*GIT, "commit", "-qm", "diamond", cwd=root)
    run("git", "init", "-q", "--bare", "-b", "main", str(tmp_path / "origin.git"), cwd=tmp_path)
    run("git", "remote", "add", "origin", str(tmp_path / "origin.git"), cwd=root)
    run("git", "push", "-q", "origin", "HEAD:refs/heads/main", cwd=root)
    return root


def test_plan_graph_gives_each_stage_its_upstream_stages_in_dvc_order(diamond):
    graph = plan_graph([], diamond)
    assert {stage: sorted(ups) for stage, ups in graph.items()} == {"a": [], "b": ["a"], "c": ["a"],
                                                                     "d": ["b", "c"]}
    assert list(graph)[0] == "a" and list(graph)[-1] == "d"  # upstream first
    assert plan_graph(["c"], diamond) == {"a": [], "c": ["a"]}


def test_a_pool_runs_a_commit_so_uncommitted_tracked_changes_are_refused_in_one_line(diamond):
    (diamond / "dvc.yaml").write_text((diamond / "dvc.yaml").read_text() + "# edited\n")
    refusal = r"^work on a pool runs from a commit: commit or stash dvc.yaml first$"
    with pytest.raises(PipelineError, match=refusal):
        push_baseline(diamond, "origin", "sweep-1")
    run("git", "checkout", "dvc.yaml", cwd=diamond)
    run(sys.executable, "-m", "dvc", "repro", "-q", "a", cwd=diamond)  # writes dvc.lock (new, untracked)
    ref = push_baseline(diamond, "origin", "sweep-1", allowed={"dvc.lock"})
    assert ref == f"{SWEEP_REF_PREFIX}sweep-1"
    head = run("git", "rev-parse", "HEAD", cwd=diamond)
    assert run("git", "ls-remote", str(diamond.parent / "origin.git"), ref, cwd=diamond).split()[0] == head


def test_a_carried_file_travels_in_a_commit_made_aside_leaving_the_workspace_as_it_was(diamond, tmp_path):
    """`make run PROFILE=tiny POOL=...` composes params.yaml and fans out: the workers get that params.yaml
    without a commit by hand (the run's commit is HEAD + the workspace's copy; HEAD, index, files stay)."""
    (diamond / "params.yaml").write_text("x: 1\n")
    run("git", "add", "params.yaml", cwd=diamond)
    run(*GIT, "commit", "-qm", "params", cwd=diamond)
    (diamond / "params.yaml").write_text("x: 2\n")                                  # the composed profile
    head = run("git", "rev-parse", "HEAD", cwd=diamond)
    ref = push_baseline(diamond, "origin", "reproduce-1", allowed={"dvc.lock"}, carried={"params.yaml"})
    origin = str(tmp_path / "origin.git")
    pushed = run("git", "ls-remote", origin, ref, cwd=diamond).split()[0]
    assert run("git", "--git-dir", origin, "show", f"{pushed}:params.yaml", cwd=tmp_path) == "x: 2"
    assert run("git", "--git-dir", origin, "rev-parse", f"{pushed}^", cwd=tmp_path) == head
    assert run("git", "rev-parse", "HEAD", cwd=diamond) == head                   # the branch did not move
    assert run("git", "status", "--porcelain", cwd=diamond) == "M params.yaml"    # still the user's change
    (diamond / "dvc.yaml").write_text((diamond / "dvc.yaml").read_text() + "# edited\n")
    with pytest.raises(PipelineError, match=r"commit or stash dvc.yaml first$"):  # only the carried ones
        push_baseline(diamond, "origin", "reproduce-2", carried={"params.yaml"})
    run("git", "checkout", "dvc.yaml", "params.yaml", cwd=diamond)


def test_private_clone_runs_the_pushed_commit_on_the_worker_clones_cache_and_remote(diamond, tmp_path):
    ref = push_baseline(diamond, "origin", "sweep-2")
    worker = tmp_path / "worker"
    run("git", "clone", "-q", str(tmp_path / "origin.git"), str(worker), cwd=tmp_path)
    work = private_clone(worker, "origin", ref, worker / ".dvc" / "tmp" / "pool" / "exp-1")
    assert run("git", "rev-parse", "HEAD", cwd=work) == run("git", "rev-parse", "HEAD", cwd=diamond)
    local = (work / ".dvc" / "config.local").read_text()
    assert str(tmp_path / "dvc-remote") in local  # the worker clone's remote, absolute: not ../../ of `work`
    assert str(worker / ".dvc" / "cache") in local
    run(sys.executable, "-m", "dvc", "repro", "-q", "b", cwd=work)
    run(sys.executable, "-m", "dvc", "push", "-q", "b", cwd=work)
    outs = stage_outs(work, ["a", "b"])
    assert set(outs) == {"a.txt", "score.json", "b.txt"}  # dvc.lock's outs, metrics included
    assert workspace_metrics(work) == {"size.a": 1.5, "n": 2.0}  # what an experiment logs and reports
    pushed = tmp_path / "dvc-remote" / "files" / "md5" / outs["b.txt"][:2] / outs["b.txt"][2:]
    assert pushed.read_text() == "a\n"


@contextlib.contextmanager
def refusing_writes(folder: Path) -> Iterator[None]:
    """`folder` read-only: its mode, and for root (whom modes do not stop) the immutable flag, as a lab's
    remote mounted read-only or without write permission refuses a push."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o555)
    as_root = os.geteuid() == 0
    if as_root and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        folder.chmod(0o755)
        pytest.skip("root without chattr +i: no way to make a folder refuse writes")
    try:
        yield
    finally:
        if as_root:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(0o755)


def test_a_push_is_all_or_nothing_no_ref_on_origin_without_its_data(diamond, tmp_path):
    for key, value in (("user.name", "test"), ("user.email", "test@localhost")):  # DVC commits the experiment
        run("git", "config", key, value, cwd=diamond)
    run(sys.executable, "-m", "dvc", "exp", "run", "-q", "--name", "exp-1", "b", cwd=diamond)
    origin, dvc_remote = str(tmp_path / "origin.git"), tmp_path / "dvc-remote"

    def exp_refs() -> list[str]:
        return [line.split()[1] for line in run("git", "ls-remote", origin, cwd=tmp_path).splitlines()
                if "refs/exps/" in line]

    with refusing_writes(dvc_remote), pytest.raises(DvcCommandError) as refused:
        push_experiment(diamond, "origin", "exp-1", echo=lambda line: None)
    why = str(refused.value)
    assert why.startswith("its data did not reach the DVC remote, so its git ref was not pushed: ERROR: ")
    assert "\n" not in why and ("Operation not permitted" in why or "Permission denied" in why)
    assert exp_refs() == []  # the ref stayed in the clone
    push_experiment(diamond, "origin", "exp-1", echo=lambda line: None)  # the remote writable again
    assert [ref.rsplit("/", 1)[-1] for ref in exp_refs()] == ["exp-1"]
    digest = stage_outs(diamond, ["b"])["b.txt"]
    assert (dvc_remote / "files" / "md5" / digest[:2] / digest[2:]).read_text() == "a\n"
    assert any(path.is_file() for path in (dvc_remote / "runs").rglob("*"))  # DVC's run cache as well


def test_work_on_a_pool_needs_servers_the_other_machines_reach(monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.workpool import check_shared_services

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////tmp/local.db")
    monkeypatch.delenv("PARALLEL_R1_TRACKING", raising=False)
    with temporary_settings(restore_defaults={PREFECT_API_URL}), \
            pytest.raises(PipelineError, match=r"^sweep on a pool: PREFECT_API_URL is not set;"):
        check_shared_services("sweep on a pool")
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        with pytest.raises(PipelineError, match=r"^worker: MLFLOW_TRACKING_URI is sqlite:////tmp/local.db, "):
            check_shared_services("worker")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
        check_shared_services("worker")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////tmp/local.db")
        monkeypatch.setenv("PARALLEL_R1_TRACKING", "off")
        check_shared_services("worker")


def test_setup_writes_a_relative_dvc_remote_absolute_where_exp_pull_reads_it_and_keeps_a_users_own(tmp_path):
    """`dvc exp pull` read the committed relative remote from each commit's tree and fetched nothing; `make
    setup` writes its absolute path into config.local, updates what it wrote, keeps a user's own URL."""
    from configobj import ConfigObj

    from flows.remote import LOCALIZED, localize_remote

    clone = tmp_path / "lab" / "clone"
    clone.mkdir(parents=True)
    run(sys.executable, "-m", "dvc", "init", "-q", "--no-scm", cwd=clone)
    committed = "[core]\n    remote = storage\n['remote \"storage\"']\n    url = ../../shared-remote\n"
    (clone / ".dvc" / "config").write_text(committed)   # as the project's: relative to .dvc/

    def local_url() -> str | None:
        local = clone / ".dvc" / "config.local"
        return ConfigObj(str(local)).get('remote "storage"', {}).get("url") if local.is_file() else None

    expected = str(tmp_path / "lab" / "shared-remote")
    assert localize_remote(clone) == expected and local_url() == expected
    assert localize_remote(clone) == expected and local_url() == expected        # every setup: unchanged
    run(sys.executable, "-m", "dvc", "remote", "modify", "storage", "url", "s3://bucket/remote", cwd=clone)
    assert localize_remote(clone) is None and local_url() is None                 # the committed URL rules
    assert not (clone / LOCALIZED).exists()
    (clone / ".dvc" / "config").write_text(committed)
    run(sys.executable, "-m", "dvc", "remote", "modify", "--local", "storage", "url", "/mnt/mine", cwd=clone)
    assert localize_remote(clone) is None and local_url() == "/mnt/mine"          # a user's own: kept


def test_a_run_is_launched_again_when_it_crashed_or_lacked_a_resource_not_on_its_own_error():
    from types import SimpleNamespace

    from flows.workpool import worth_another_attempt
    from parallel_r1.errors import RESOURCE_MARK, ResourceShortage

    def state(kind: str, message: str = "") -> SimpleNamespace:
        return SimpleNamespace(type=SimpleNamespace(value=kind), message=message)

    error = ResourceShortage("x: too little")
    shortage = f"Flow run encountered an exception: DvcCommandError: error: {error}"
    assert RESOURCE_MARK in shortage
    assert worth_another_attempt(state("CRASHED", "its worker died"))
    assert worth_another_attempt(state("FAILED", shortage))
    assert not worth_another_attempt(state("FAILED", "error: params.yaml rl.lr: must be > 0"))
    assert not worth_another_attempt(state("COMPLETED", shortage))


def test_the_timeline_aligns_long_names_and_names_the_worker_of_a_run_that_failed():
    from datetime import datetime, timezone
    from types import SimpleNamespace

    from flows.remote import unique_id
    from flows.workpool import WORKER_LABEL, format_timeline, timeline_query, timeline_row

    def flow_run(name: str, state: str, worker: str, minute: int) -> SimpleNamespace:
        return SimpleNamespace(name=name, state=SimpleNamespace(type=SimpleNamespace(value=state)),
                               labels={WORKER_LABEL: worker}, end_time=None,
                               start_time=datetime(2026, 12, 7, 0, minute, tzinfo=timezone.utc))

    sweep_id = unique_id("sweep")
    done = timeline_row(flow_run(f"{sweep_id}-1", "COMPLETED", "node-1-clone", 1), {"worker": "node-1-clone"})
    long_name = f"{sweep_id}-2-parallel_r1_unseen_s1-alternating-seed3"
    failed = timeline_row(flow_run(long_name, "FAILED", "gpu-node-17.lab.example.org-parallel-r1", 2), None)
    assert failed["worker"] == "gpu-node-17.lab.example.org-parallel-r1"  # no result row: the worker's label
    header, *lines = format_timeline([done, failed])
    assert header.split() == ["name", "worker", "state", "start", "end"]
    for column, values in (("worker", ("node-1-clone", "gpu-node-17")), ("state", ("COMPLETED", "FAILED")),
                           ("start", ("2026-12-07T00:01", "2026-12-07T00:02"))):
        starts = [line.index(value) for line, value in zip(lines, values, strict=True)]
        assert starts == [header.index(column)] * 2
    # the ids the flows log are the ones `python -m flows.workpool timeline <id>` looks up
    assert timeline_query(sweep_id) == (f"sweep:{sweep_id}", "experiment-result")
    reproduce_id = unique_id("reproduce")
    assert timeline_query(reproduce_id) == (f"reproduce:{reproduce_id}", "stage-result")


def test_a_worker_killed_with_its_process_group_takes_dvc_and_its_stage_with_it(tmp_path):
    """run_dvc starts DVC in its own session (a stopped flow run stops it with one killpg), which a worker's
    `kill -9 -- -<pgid>` does not reach: flows/dvc_supervisor.py, the session's leader, ends it instead."""
    import signal
    import time

    import psutil

    from flows.dvc_runner import STOP_GRACE_S

    project = tmp_path / "project"
    project.mkdir()
    run(sys.executable, "-m", "dvc", "init", "-q", "--no-scm", cwd=project)
    sleeper = "import os, time; open('stage.pid', 'w').write(str(os.getpid())); time.sleep(300)"
    (project / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": {
        "cmd": f'python -c "{sleeper}"', "outs": ["model.txt"]}}}))
    launch = f"from flows.dvc_runner import run_dvc; run_dvc(['repro'], cwd={str(project)!r})"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), DVC_NO_ANALYTICS="1")
    worker = subprocess.Popen([sys.executable, "-c", launch], env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = []  # the worker's descendants, killed at the end whatever happened
    try:
        deadline = time.monotonic() + 60
        while not (project / "stage.pid").is_file() or not (project / "stage.pid").read_text():
            assert worker.poll() is None and time.monotonic() < deadline, "the stage did not start"
            time.sleep(0.2)
        started = psutil.Process(worker.pid).children(recursive=True)  # supervisor, DVC, the stage
        assert int((project / "stage.pid").read_text()) in {process.pid for process in started}
        assert all(os.getpgid(process.pid) != worker.pid for process in started)  # out of the worker's group
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        _, alive = psutil.wait_procs(started, timeout=STOP_GRACE_S + 10)
        assert not [process for process in alive if process.status() != psutil.STATUS_ZOMBIE]
    finally:
        for process in started:
            with contextlib.suppress(psutil.Error):
                process.kill()


def test_a_killed_dvc_leaves_no_lock_entries_that_warn_on_later_commands(tmp_path):
    """`kill -9` of DVC itself (not its stage): its read and write entries stayed in .dvc/tmp/rwlock, and each
    later command whose paths overlap some of them warned "... had been killed. Auto removed it from the lock
    file". The supervisor stops the stage DVC left behind and drops DVC's entries."""
    import json
    import threading
    import time

    import psutil

    from flows.dvc_runner import DvcCommandError, run_dvc

    project = tmp_path / "project"
    project.mkdir()
    run(sys.executable, "-m", "dvc", "init", "-q", "--no-scm", cwd=project)
    (project / "data.txt").write_text("input")
    sleeper = "import os, time; open('stage.pid', 'w').write(str(os.getpid())); time.sleep(300)"
    (project / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": {
        "cmd": f'python -c "{sleeper}"', "deps": ["data.txt"], "outs": ["model.txt"]}}}))
    rwlock, pid_file, seen = project / ".dvc" / "tmp" / "rwlock", project / "stage.pid", {}

    def kill_dvc_once_its_stage_runs() -> None:
        deadline = time.monotonic() + 60
        while not (pid_file.is_file() and pid_file.read_text()):
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
        seen["stage"] = psutil.Process(int(pid_file.read_text()))
        dvc = next(process for process in seen["stage"].parents() if "dvc" in process.cmdline())
        seen["held"] = {info["pid"] for info in json.loads(rwlock.read_text())["write"].values()}
        seen["dvc"] = dvc.pid
        dvc.kill()

    killer = threading.Thread(target=kill_dvc_once_its_stage_runs, daemon=True)
    killer.start()
    try:
        with pytest.raises(DvcCommandError):
            run_dvc(["repro"], cwd=project, echo=lambda line: None)
        killer.join(timeout=60)
        assert seen.get("dvc") in seen.get("held", ()), seen   # DVC held its outputs when it was killed
        assert json.loads(rwlock.read_text()) == {}
        assert not seen["stage"].is_running() or seen["stage"].status() == psutil.STATUS_ZOMBIE
        for _ in range(2):
            done = subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=project, capture_output=True,
                                  text=True, env=dict(os.environ, DVC_NO_ANALYTICS="1"))
            assert "had been killed" not in done.stdout + done.stderr
    finally:
        with contextlib.suppress(psutil.Error, KeyError):
            seen["stage"].kill()


def test_a_stopped_dvc_command_returns_once_its_stage_has_cleaned_up(tmp_path):
    """A stopped flow run (an exception inside `DvcStream`, Ctrl-C) SIGTERMs DVC's group; under the supervisor
    the stop returns when the stage's own SIGTERM handler (stages put their outputs back) has finished."""
    import psutil

    from flows.dvc_runner import DvcStream

    project = tmp_path / "project"
    project.mkdir()
    run(sys.executable, "-m", "dvc", "init", "-q", "--no-scm", cwd=project)
    (project / "stage.py").write_text(
        "import os, signal, sys, time\n"
        "def clean_up(signum, frame):\n"
        "    time.sleep(1)\n"
        "    open('cleaned', 'w').close()\n"
        "    sys.exit(1)\n"
        "signal.signal(signal.SIGTERM, clean_up)\n"
        "open('stage.pid', 'w').write(str(os.getpid()))\n"
        "print('started', flush=True)\n"
        "time.sleep(300)\n")
    (project / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": {
        "cmd": "python stage.py", "deps": ["stage.py"], "outs": ["model.txt"]}}}))
    with pytest.raises(KeyboardInterrupt), DvcStream(["repro"], project) as stream:
        for line in stream:
            if line == "started":
                raise KeyboardInterrupt
    assert (project / "cleaned").is_file()  # the stage's handler ran to its end before the stop returned
    stage = int((project / "stage.pid").read_text())
    assert not psutil.pid_exists(stage) or psutil.Process(stage).status() == psutil.STATUS_ZOMBIE


def test_a_fanned_out_reproduce_logs_the_id_its_timeline_is_looked_up_by(monkeypatch, tmp_path):
    import re
    from types import SimpleNamespace

    from flows import reproduce
    from flows.workpool import timeline_query

    logged = []
    logger = SimpleNamespace(info=lambda message, *args: logged.append(message % args))
    monkeypatch.setattr(reproduce, "get_run_logger", lambda: logger)
    monkeypatch.setattr(reproduce, "plan_graph", lambda stages, root: {})  # nothing to run
    reproduce._fan_out("parallel-r1", "origin", [], tmp_path, False, None, {})
    (line,) = logged
    reproduce_id = line.split(":", 1)[0]
    assert re.fullmatch(r"reproduce-20\d{6}-\d{6}-[0-9a-f]{6}", reproduce_id)
    assert f"`python -m flows.workpool timeline {reproduce_id}`" in line
    assert timeline_query(reproduce_id)[0] == f"reproduce:{reproduce_id}"  # the tag _run_on_pool gives runs
