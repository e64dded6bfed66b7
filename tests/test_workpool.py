"""The pieces of the work pool that need no server: the stage graph a fan-out schedules from, the commit a
pool runs (pushed, or refused with one line), and the private clone a worker runs it in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.dvc_runner import plan_graph, workspace_metrics
from flows.remote import SWEEP_REF_PREFIX, private_clone, push_baseline, stage_outs
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
