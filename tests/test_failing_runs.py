"""A failing run neither loses nor half-publishes outputs: checks come first, writes are atomic and
all-or-nothing, and every DVC output is in the cache so `dvc checkout` restores it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import copy_repo, set_param, teacher_row, write_teacher

REPO = Path(__file__).resolve().parents[1]


def write_teachers(root: Path, gsm8k: str, dapo: str) -> None:
    write_teacher(root, "gsm8k", gsm8k)
    write_teacher(root, "dapo", dapo)


OUTPUTS = ("metrics/filter/gsm8k.json", "metrics/filter/dapo.json", "data/sft/parallel_gsm8k.jsonl")


@pytest.fixture
def filtered(workdir):
    """A project folder where the filter has run once: its outputs are the 'previous' ones."""
    from stages.filter import main

    write_teachers(workdir, json.dumps(teacher_row()) + "\n", json.dumps(teacher_row(id="d-1")) + "\n")
    main()
    return {name: (workdir / name).read_bytes() for name in OUTPUTS}


@pytest.mark.parametrize("broken", ["zero_kept", "bad_second_file"])
def test_failing_filter_leaves_every_previous_output_in_place(filtered, tmp_path, capsys, broken):
    from stages.filter import main

    unformatted = json.dumps(teacher_row(completion="no block\nFinal Answer: 3")) + "\n"
    if broken == "zero_kept":          # used to write an empty SFT file, then raise
        write_teachers(tmp_path, unformatted, json.dumps(teacher_row(id="d-1")) + "\n")
    else:                              # used to replace gsm8k's metrics, then fail on dapo's file
        write_teachers(tmp_path, unformatted + json.dumps(teacher_row(id="g-2")) + "\n",
                       '{"id": "d-1", "ques')
    with pytest.raises(SystemExit):
        main()
    assert capsys.readouterr().err.startswith("error: data/teacher/")
    assert {name: (tmp_path / name).read_bytes() for name in OUTPUTS} == filtered
    assert not [p for p in tmp_path.rglob(".*") if p.is_file()]   # no temporary file left behind


def test_every_dvc_output_is_cached_so_checkout_restores_it():
    """/metrics and /reports are git-ignored: an uncached output there could never be restored."""
    from dvc.repo import Repo

    with Repo(str(REPO)) as repo:
        uncached = [f"{stage.addressing}: {out.def_path}" for stage in repo.index.stages
                    for out in stage.outs if not out.use_cache]
    assert uncached == []


def test_bad_dataset_entry_names_its_param_path_before_any_dataset_is_read(workdir, capsys):
    from stages.prepare_data import main

    tmp_path = workdir   # no mirror/ here: reading any dataset would fail
    set_param(tmp_path / "params.yaml", "data.eval.math.limit", "-2")
    with pytest.raises(SystemExit):
        main()
    assert capsys.readouterr().err.strip() == ("error: params.yaml data.eval.math.limit: "
                                               "must be an integer >= 1 "
                                               "or null, got -2")
    assert not (tmp_path / "data").exists()


def dvc(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PARALLEL_R1_TRACKING": "off",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=env, capture_output=True,
                          text=True)


def tree(root: Path, names) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for name in names
            for path in ([root / name] if (root / name).is_file() else sorted((root / name).rglob("*")))}


@pytest.mark.slow
@pytest.mark.parametrize("stage, outputs, key, error", [
    ("filter", OUTPUTS, "filter.max_tokens", "params.yaml filter.max_tokens: must be >= 1, got -5"),
    ("prepare_data", ("data/rl", "data/eval"), "data.rl.gsm8k.limit",
     "params.yaml data.rl.gsm8k.limit: must be an integer >= 1 or null, got -5"),
])
def test_failed_repro_leaves_the_previous_outputs_in_place(tmp_path, mirror, stage, outputs, key, error):
    """DVC removes a stage's outputs before running it: a params typo used to leave none in the workspace."""
    repo = copy_repo(tmp_path / "repo", mirror)
    write_teachers(repo, json.dumps(teacher_row()) + "\n", json.dumps(teacher_row(id="d-1")) + "\n")
    first = dvc(repo, "repro", "--single-item", stage)
    assert first.returncode == 0, first.stderr[-2000:]
    before = tree(repo, outputs)
    assert before

    set_param(repo / "params.yaml", key, "-5")   # a params typo: the stage stops at once
    failed = dvc(repo, "repro", "--single-item", stage)
    assert failed.returncode != 0
    [line] = [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
    assert line == f"error: {error} (its previous outputs are restored from the DVC cache)"
    assert tree(repo, outputs) == before


# ---------------------------------------------------------------- killed runs in MLflow

KILLED_STAGE = """
import os, signal
from parallel_r1 import tracking
with tracking.stage_run("sft", "seen", params={"profile": "tiny"}):
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_run_killed_with_sigkill_is_closed_by_the_next_run_of_any_stage(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from parallel_r1 import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "killed")
    monkeypatch.delenv("PARALLEL_R1_TRACKING", raising=False)
    monkeypatch.delenv("PARALLEL_R1_PARENT_RUN_ID", raising=False)
    child = subprocess.run([sys.executable, "-c", KILLED_STAGE], env={**os.environ, "PYTHONPATH": str(REPO)},
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == -9, child.stderr[-2000:]
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("killed").experiment_id
    [orphan] = client.search_runs([experiment], "attributes.status = 'RUNNING'")
    with tracking.stage_run("sft", "unseen", params={"profile": "tiny"}) as other:   # another stage closes it
        assert client.get_run(orphan.info.run_id).info.status == "KILLED"             # (used to stay RUNNING)
        client.set_terminated(orphan.info.run_id, status="RUNNING")
        assert tracking.close_orphaned_runs() == [orphan.info.run_id]                  # `make ui` closes all
        assert client.get_run(other).info.status == "RUNNING"                          # a live run stays
    assert client.get_run(orphan.info.run_id).info.status == "KILLED"

    client.set_terminated(orphan.info.run_id, status="RUNNING")
    with tracking.stage_run("sft", "seen", params={"profile": "tiny"}):              # the same stage again
        assert client.get_run(orphan.info.run_id).info.status == "KILLED"


# ---------------------------------------------------------------- write errors, file modes, Ctrl-C

def test_write_error_is_one_line_and_the_filter_publishes_all_its_outputs_or_none(filtered, workdir):
    """Under `ulimit -f 64` the filter used to print a 25-line OSError traceback after replacing its metrics
    but not its SFT set."""
    long_row = teacher_row(question="x" * 2000)
    rows = "".join(json.dumps({**long_row, "id": f"g-{i}"}) + "\n" for i in range(60))   # ~140 kB kept
    write_teachers(workdir, rows, json.dumps(teacher_row(id="d-1", question="new")) + "\n")
    done = subprocess.run(["bash", "-c", f"ulimit -f 64 && exec {sys.executable} -m stages.filter"],
                          cwd=workdir, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: data/sft/parallel_gsm8k.jsonl: cannot write (File too large, EFBIG)"]
    assert {name: (workdir / name).read_bytes() for name in OUTPUTS} == filtered       # none replaced
    assert not [p for p in workdir.rglob(".*") if p.is_file()]                          # no temporary left


def test_published_outputs_get_the_mode_of_any_new_file(filtered, workdir):
    """The temporary file's 0600 used to survive the rename (data/sft/parallel_gsm8k.jsonl was 0600)."""
    from parallel_r1.io import atomic_path, current_umask

    assert current_umask() == os.umask(current_umask())
    for name in OUTPUTS:
        assert (workdir / name).stat().st_mode & 0o777 == 0o666 & ~current_umask(), name
    with atomic_path(workdir / "models" / "m", is_dir=True) as tmp:
        (tmp / "config.json").write_text("{}")
    assert (workdir / "models" / "m").stat().st_mode & 0o777 == 0o777 & ~current_umask()


CTRL_C_STAGE = """
import sys
from stages.common import stage_main
@stage_main
def main():
    raise KeyboardInterrupt
main()
"""


def test_os_error_outside_the_io_module_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-c", CTRL_C_STAGE.replace(
        "raise KeyboardInterrupt", "open('checkpoints/x', 'w')")], cwd=tmp_path, capture_output=True,
        text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == ["error: checkpoints/x: No such file or directory (ENOENT)"]


def test_a_failed_tree_copy_names_its_first_file_not_a_list(tmp_path):
    """shutil.copytree gathers its failures into one error whose message is a nested list (a model copied
    onto a full disk printed `[('models/a/model.safetensors', ...)]`)."""
    failures = "[('a/x', 'b/x', '[Errno 27] File too large'), ('a/y', 'b/y', '[Errno 27] File too large')]"
    code = CTRL_C_STAGE.replace("raise KeyboardInterrupt", f"import shutil; raise shutil.Error({failures})")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == ["error: b/x: [Errno 27] File too large (and 1 more files)"]


def test_ctrl_c_in_a_stage_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-c", CTRL_C_STAGE], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert done.returncode == 130
    assert done.stderr.strip().splitlines() == [
        "error: interrupted (Ctrl-C); this stage published nothing more"]


HELD_STAGE = """
import os, pathlib, time
from stages.common import stage_main

@stage_main
def main():
    if pathlib.Path("fail").exists():           # a second run that fails on a bad input
        from parallel_r1.errors import PipelineError
        raise PipelineError("input.txt: bad")
    if pathlib.Path("hold").exists():           # the second run: wait to be stopped
        pathlib.Path("pid").write_text(str(os.getpid()))
        while True:
            time.sleep(0.1)
    pathlib.Path("out.txt").write_text("good " + pathlib.Path("input.txt").read_text())

main()
"""


@pytest.fixture
def held(tmp_path) -> Path:
    """A DVC project whose one stage wrote out.txt once (dvc.lock records it), then, made stale, runs until
    it is stopped."""
    (tmp_path / "held.py").write_text(HELD_STAGE)
    (tmp_path / "input.txt").write_text("1")
    stage = {"cmd": "python held.py", "deps": ["held.py", "input.txt"], "outs": ["out.txt"]}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"held": stage}}))
    (tmp_path / "params.yaml").write_text("profile: tiny\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PARALLEL_R1_TRACKING": "off"}
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    for args in (["init", "-q"], ["repro"]):
        subprocess.run([sys.executable, "-m", "dvc", *args], cwd=tmp_path, env=env, check=True,
                       capture_output=True)
    assert (tmp_path / "out.txt").read_text() == "good 1"
    (tmp_path / "input.txt").write_text("2")
    (tmp_path / "hold").touch()
    return tmp_path


@pytest.mark.parametrize("how", ["SIGINT to dvc repro's stage", "SIGTERM to dvc repro's stage",
                                 "SIGINT to make run", "SIGTERM to make run"])
def test_a_stage_stopped_by_a_signal_leaves_the_outputs_dvc_lock_records(held, how):
    """DVC deletes a stage's outputs before it runs it and puts nothing back when it is interrupted: the
    stage does (Ctrl-C is SIGINT; `make run`, stopped, sends its stage SIGTERM), so out.txt is the one
    dvc.lock records, not lost."""
    signum = signal.SIGINT if how.startswith("SIGINT") else signal.SIGTERM
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    env.update(PYTHONPATH=str(REPO), PARALLEL_R1_TRACKING="off", PREFECT_HOME=str(held / ".prefect"))
    command = ([sys.executable, "-m", "flows.reproduce"] if how.endswith("make run")
               else [sys.executable, "-m", "dvc", "repro"])
    # a terminal's SIGINT disposition: pytest-xdist workers ignore SIGINT, and an ignored SIGINT is inherited
    run = subprocess.Popen(command, cwd=held, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while not (held / "pid").exists():
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0][-2000:]
        time.sleep(0.1)
    assert not (held / "out.txt").exists()             # DVC removed it before the stage began
    os.kill(run.pid if how.endswith("make run") else int((held / "pid").read_text()), signum)
    output = run.communicate(timeout=120)[0]
    assert run.returncode != 0
    deadline = time.monotonic() + 60                   # the stage may finish putting it back after DVC ended
    while not (held / "out.txt").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (held / "out.txt").read_text() == "good 1", output[-2000:]
    assert "its previous outputs are restored from the DVC cache" in output or how.endswith("make run")


def test_a_corrupted_cache_copy_is_refused_before_it_reaches_the_workspace(held):
    """The failure path puts the previous outputs back from the DVC cache, which DVC does not re-hash: a
    flipped byte there would be published silently."""
    (held / "hold").unlink()
    (held / "fail").touch()
    [cached] = [path for path in (held / ".dvc/cache/files/md5").rglob("*") if path.is_file()]
    cached.chmod(0o644)
    cached.write_text("evil 1")   # the size kept: only the bytes differ
    env = {**os.environ, "PYTHONPATH": str(REPO), "PARALLEL_R1_TRACKING": "off"}
    failed = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=held, env=env, capture_output=True,
                            text=True, timeout=300)
    assert failed.returncode != 0
    [line] = [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
    assert line.startswith("error: input.txt: bad (previous outputs not restored: out.txt: its DVC cache "
                           "copy ")
    assert f"{cached.name} is corrupted (delete it, then `dvc pull held` or rerun the stage)" in line
    assert not (held / "out.txt").exists()


def test_zero_rows_error_counts_every_reason_rows_were_dropped(workdir, capsys):
    """Used to list Algorithm 1's reasons only ({'no_parallel_block': 1}) while the token cap dropped the
    rest."""
    from conftest import one_line_error
    from stages.filter import main

    rows = [teacher_row(id=f"g-{i}", completion_tokens=30) for i in range(3)]
    rows.append(teacher_row(id="g-3", completion="no block\nFinal Answer: 3"))
    rows.append(teacher_row(id="g-4", completion="<Parallel><Path>a</Path><Path>b</Path></Parallel>"
                                                 "<Summary>s</Summary>\nFinal Answer: none"))
    write_teachers(workdir, "".join(json.dumps(row) + "\n" for row in rows), json.dumps(teacher_row()) + "\n")
    set_param(workdir / "params.yaml", "filter.max_tokens", "1")
    assert one_line_error(main, capsys) == (
        "error: data/teacher/gsm8k.jsonl: the filter kept 0 of 5 rows — no SFT data (dropped: over "
        "filter.max_tokens: 3, no_parallel_block: 1, no_numeric_answer (filter.require_numeric_answer): 1)")


# ---------------------------------------------------------------- a killed teacher generation

class FakeTeacher:
    """A rollout engine that answers `chunks` chunks, then is interrupted (Ctrl-C)."""

    def __init__(self, chunks: int):
        self.chunks, self.prompts = chunks, 0

    def generate(self, prompt_ids, n):
        if self.chunks == 0:
            raise KeyboardInterrupt
        self.chunks -= 1
        self.prompts += len(prompt_ids)
        from types import SimpleNamespace
        return [SimpleNamespace(text="<think>t</think>Final Answer: 1", truncated=False) for _ in prompt_ids]


def test_killed_teacher_generation_keeps_its_partial_file_where_no_dataset_reader_looks(workdir, mirror,
                                                                                        monkeypatch, capsys):
    """Used to leave data/teacher/.dapo.partial.jsonl, which validate then read as a dataset after a
    checkout."""
    import parallel_r1.engine
    import stages.generate
    from stages.validate import dataset_paths
    from test_bad_inputs import fake_model_dir

    fake_model_dir(workdir / "models" / "base")
    set_param(workdir / "params.yaml", "data.mirror_dir", json.dumps(str(mirror)))
    set_param(workdir / "params.yaml", "generate_datasets.dapo.limit", "5")
    monkeypatch.setattr(stages.generate, "CHUNK", 2)
    teacher = FakeTeacher(chunks=1)
    monkeypatch.setattr(parallel_r1.engine, "make_engine", lambda *args, **kwargs: teacher)
    with pytest.raises(SystemExit) as stopped:
        stages.generate.main(["dapo"])
    assert stopped.value.code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: interrupted (Ctrl-C)")
    assert len((workdir / "data/partial/teacher/dapo.jsonl").read_text().splitlines()) == 2
    assert not (workdir / "data/teacher").exists()
    # a checkout
    write_teachers(workdir, json.dumps(teacher_row()) + "\n", json.dumps(teacher_row(id="d-1")) + "\n")
    (workdir / "data/teacher/.gsm8k.partial.jsonl").write_text("")          # an older version's leftover
    assert [p.name for p in dataset_paths([])] == ["dapo.jsonl", "gsm8k.jsonl"]

    teacher.chunks = 5                                                       # the rerun resumes
    stages.generate.main(["dapo"])
    assert teacher.prompts == 2 + 3
    assert len((workdir / "data/teacher/dapo.jsonl").read_text().splitlines()) == 5
    assert not (workdir / "data/partial/teacher/dapo.jsonl").exists()


@pytest.mark.slow
def test_run_of_a_killed_stage_restored_from_the_run_cache_is_closed(tmp_path, mirror, monkeypatch):
    """kill -9 a stage, then `make run`: DVC restores the stage's outputs from its run cache, so no run of
    that name starts again, and its MLflow run used to stay RUNNING."""
    from mlflow import MlflowClient

    repo = copy_repo(tmp_path / "repo", mirror)
    write_teachers(repo, json.dumps(teacher_row()) + "\n", json.dumps(teacher_row(id="d-1")) + "\n")
    assert dvc(repo, "repro", "--single-item", "filter").returncode == 0
    uri = f"sqlite:///{repo / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "restored")
    monkeypatch.delenv("PARALLEL_R1_TRACKING", raising=False)
    monkeypatch.delenv("PARALLEL_R1_PARENT_RUN_ID", raising=False)
    killed = subprocess.run([sys.executable, "-c", KILLED_STAGE.replace('"sft", "seen"', '"filter"')],
                            cwd=repo, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    for name in OUTPUTS:                  # DVC had removed the outputs before the stage was killed
        (repo / name).unlink()
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("restored").experiment_id
    [orphan] = client.search_runs([experiment], "attributes.status = 'RUNNING'")

    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    env.update(PYTHONPATH=str(REPO), PREFECT_HOME=str(tmp_path / "prefect"))  # make run's temporary Prefect
    done = subprocess.run([sys.executable, "-m", "flows.reproduce", "--single-item", "filter"], cwd=repo,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all((repo / name).is_file() for name in OUTPUTS)                 # restored, the stage not run
    assert [run.info.run_name
            for run in client.search_runs([experiment], "")] == ["reproduce@filter", "filter"]
    assert client.get_run(orphan.info.run_id).info.status == "KILLED"


def test_published_files_get_one_mode_whoever_wrote_them(tmp_path):
    """A library that saves through its own 0600 temporary (transformers' model.safetensors) publishes with
    the mode any new file gets under the umask, as DVC's restored copies have; execute bits stay."""
    import os

    from parallel_r1.io import atomic_path, current_umask

    with atomic_path(tmp_path / "model", is_dir=True) as folder:
        weights = folder / "model.safetensors"
        weights.write_bytes(b"w")
        weights.chmod(0o600)
        (folder / "steps").mkdir(mode=0o700)
        (folder / "steps" / "config.json").write_text("{}")
        os.chmod(folder / "steps" / "config.json", 0o600)
        (folder / "run.sh").write_text("#!/bin/sh\n")
        (folder / "run.sh").chmod(0o700)
    mask = current_umask()
    modes = {path.relative_to(tmp_path).as_posix(): path.stat().st_mode & 0o777
             for path in (tmp_path / "model", *sorted((tmp_path / "model").rglob("*")))}
    assert modes == {"model": 0o777 & ~mask, "model/model.safetensors": 0o666 & ~mask,
                     "model/run.sh": 0o777 & ~mask, "model/steps": 0o777 & ~mask,
                     "model/steps/config.json": 0o666 & ~mask}


@pytest.mark.parametrize("key,value", [("reward", "nosuch_reward"), ("init", "nosuch_model")])
def test_a_run_name_typo_is_refused_by_make_run_before_dvc_deletes_anything(tmp_path, mirror, key, value):
    """Under `dvc repro` DVC deleted models/<run> and then failed on the missing param or dependency, in words
    naming neither `rl_runs.<run>.reward` nor `.init`; `make run` checks the names first."""
    repo = copy_repo(tmp_path / "repo", mirror)
    run = "parallel_r1_unseen_s2"
    (repo / "models" / run).mkdir(parents=True)
    (repo / "models" / run / "model.safetensors").write_text("the previous model")
    set_param(repo / "params.yaml", f"rl_runs.{run}.{key}", value)
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    env.update(PYTHONPATH=str(REPO), PARALLEL_R1_TRACKING="off", PREFECT_HOME=str(tmp_path / "prefect"))
    done = subprocess.run([sys.executable, "-m", "flows.reproduce", f"rl@{run}"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"error: params.yaml rl_runs.{run}.{key}: {value!r} is not a known ")
    assert (repo / "models" / run / "model.safetensors").read_text() == "the previous model"
