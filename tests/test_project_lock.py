"""One pipeline invocation at a time: a second `make run` (or flow, or profile switch) is refused while the
first runs a stage command, when DVC's own repo lock is released."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from parallel_r1.errors import PipelineError
from parallel_r1.project_lock import project_lock
from stages.profiles import write_params

REPO = Path(__file__).resolve().parents[1]
HOLD = """
import pathlib, time
pathlib.Path("started").touch()
while not pathlib.Path("release").exists():
    time.sleep(0.05)
pathlib.Path("held.txt").write_text("held")
"""


@pytest.fixture
def toy(tmp_path) -> Path:
    """A DVC project of two stages: `hold` runs until the file `release` exists, `other` writes other.txt."""
    (tmp_path / "hold.py").write_text(HOLD)
    stages = {"hold": {"cmd": "python hold.py", "outs": ["held.txt"]},
              "other": {"cmd": "python -c \"open('other.txt', 'w').write('other')\"", "outs": ["other.txt"]}}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    shutil.copytree(REPO / "conf", tmp_path / "conf")        # reproduce compares params.yaml with its profile
    write_params(tmp_path, "tiny")
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost"]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "toy"], cwd=tmp_path, check=True)
    return tmp_path


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def test_second_make_run_is_refused_while_the_first_runs_a_stage_command(toy):
    """Used to run (DVC releases its lock during a stage command): the second wrote other.txt and dvc.lock."""
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    env.update({"PYTHONPATH": str(REPO), "PARALLEL_R1_TRACKING": "off", "PREFECT_HOME": str(toy / ".prefect"),
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
    first = subprocess.Popen(python("-m", "flows.reproduce", "--single-item", "hold"), cwd=toy, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (toy / "started").exists():
            assert first.poll() is None, first.communicate()[0][-2000:]
            assert time.monotonic() < deadline, "the first run's stage did not start"
            time.sleep(0.1)
        for command in (python("-m", "flows.reproduce", "--single-item", "other"),
                        python("-m", "stages.profiles", "tiny")):
            second = subprocess.run(command, cwd=toy, env=env, capture_output=True, text=True, timeout=180)
            assert second.returncode == 1
            [line] = second.stderr.strip().splitlines()
            expected = (rf"error: {re.escape(str(toy))}/\.dvc/tmp/pipeline\.lock: another pipeline run "
                        rf"holds the project lock \(pid {first.pid}: python\S* -m flows\.reproduce "
                        r"--single-item hold, since [^)]+\); wait for it to end or stop it")
            assert re.fullmatch(expected, line), line
        assert not (toy / "other.txt").exists() and not (toy / "dvc.lock").exists()
    finally:
        (toy / "release").touch()
        output = first.communicate(timeout=180)[0]
    assert first.returncode == 0, output[-2000:]
    third = subprocess.run(python("-m", "flows.reproduce", "--single-item", "other"), cwd=toy, env=env,
                           capture_output=True, text=True, timeout=180)
    assert third.returncode == 0, third.stderr[-2000:]                 # released when the first ended
    assert (toy / "other.txt").read_text() == "other"


def test_lock_is_reentrant_in_one_process_and_refused_to_another(tmp_path):
    with project_lock(tmp_path) as path, project_lock(tmp_path):       # a flow switching the profile
        assert path.read_text().startswith(f"pid {os.getpid()}: ")
        probe = subprocess.run(python("-c", "import sys; from parallel_r1.project_lock import project_lock\n"
                                            "with project_lock(sys.argv[1]): pass", str(tmp_path)),
                               env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
        assert probe.returncode != 0 and "another pipeline run holds the project lock" in probe.stderr
    own_error = "another pipeline run holds the project lock (the block's own error goes on)"
    with pytest.raises(PipelineError, match=re.escape(own_error)), project_lock(tmp_path):
        raise PipelineError(own_error)
    assert path.read_text() == ""                                      # released, its holder line cleared
    released = subprocess.run(python("-c", "import sys; from parallel_r1.project_lock import project_lock\n"
                                           "with project_lock(sys.argv[1]): pass", str(tmp_path)),
                              env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert released.returncode == 0, released.stderr


def test_holder_with_a_multiline_command_is_still_named_in_one_line(tmp_path):
    holder = subprocess.Popen(python("-c", "import sys, time\n"
                                           "from parallel_r1.project_lock import project_lock\n"
                                           "with project_lock(sys.argv[1]):\n    print('held', flush=True)\n"
                                           "    time.sleep(120)", str(tmp_path)),
                              env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(PipelineError) as refused, project_lock(tmp_path):
            pass
        assert "\n" not in str(refused.value) and f"(pid {holder.pid}: python" in str(refused.value)
    finally:
        holder.kill()
        holder.wait()
