"""Two data-parallel CPU processes: `accelerate launch --config_file configs/cpu2.yaml -m stages.<stage>`.

The stages run as a user launches them (gloo on this CPU): each process rolls out its share of a
step's completions (one prompt's group of 4 is split over both, so TRL's gathered group statistics
are what the advantages use), the runtime record says 2 processes ran, the saved model loads, a killed run
resumes from its last checkpoint, and only rank 0 opens an MLflow run and writes the outputs.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from parallel_r1.data import load_teacher_demos
from parallel_r1.format import check_format
from parallel_r1.io import read_json, write_jsonl
from parallel_r1.models import load_model
from parallel_r1.training.checkpoints import last_complete_checkpoint
from tests.test_grpo import PROBLEMS, REPO, init_dir  # noqa: F401  (init_dir: the tiny policy fixture)
from tests.test_sft import SFT_PARAMS

pytestmark = pytest.mark.slow

CONFIG = REPO / "configs" / "cpu2.yaml"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_command(*stage: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
            "--main_process_port", str(free_port()), "-m", *stage]


def launch_env(root: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PARALLEL_R1_TRACKING": "on",
            "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", "TOKENIZERS_PARALLELISM": "false"}


def launch(root: Path, *stage: str) -> None:
    done = subprocess.run(launch_command(*stage), cwd=root, env=launch_env(root), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def kill_with_workers(process: subprocess.Popen) -> None:
    """SIGKILL the launcher and both ranks, as a node failure would. torch's elastic agent starts each
    rank in a session of its own, so killing the launcher's process group would leave them running."""
    import psutil

    launcher = psutil.Process(process.pid)
    workers = launcher.children(recursive=True)
    for member in [*workers, launcher]:
        member.kill()
    process.wait()
    psutil.wait_procs(workers, timeout=30)


def mlflow_runs(root: Path) -> list:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    return [run for experiment in client.search_experiments()
            for run in client.search_runs([experiment.experiment_id])]


@pytest.fixture
def project(tmp_path, init_dir) -> Path:  # noqa: F811  (the imported fixture)
    """The repository's params on the tiny profile, shrunk to 4 completions per step, and tiny models."""
    from stages.profiles import compose

    params = compose(REPO, "tiny")
    tiny = params
    tiny["rl"].update({"max_completion_tokens": 24, "per_device_batch_size": 2, "save_steps": 1})
    for dataset in ("gsm8k", "dapo"):  # 1 prompt x 4 rollouts per step: each process gets 2 of the group
        tiny["rl_datasets"][dataset] = {"batch_size": 1, "mini_batch_size": 1, "num_generations": 4,
                                        "max_steps": 2}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for name in ("gsm8k", "dapo"):
        write_jsonl(tmp_path / f"data/rl/{name}.jsonl", PROBLEMS)
    for name in ("base", "sft_seen", "sft_unseen"):
        shutil.copytree(init_dir, tmp_path / "models" / name)
    return tmp_path


def assert_two_process_run(project: Path, run: str, steps: int) -> None:
    """Both ranks ran every step of `run`, and rank 0 wrote a loadable model and its metrics."""
    summary = read_json(project / f"metrics/rl/{run}/summary.json")
    assert summary["steps"] == steps and summary["rollouts_per_step"] == 4
    history = read_json(project / f"metrics/rl/{run}/steps.json")
    assert [s["step"] for s in history] == list(range(1, steps + 1))
    assert all(s["reward_std"] is not None for s in history)  # group statistics over both ranks' rollouts
    runtime = read_json(project / f"metrics/runtime/rl/{run}.json")
    # rank 0's share of the tokens; rank 1 rolled out the rest of each group
    assert runtime["processes"] == 2 and runtime["rollout_tokens"] > 0
    load_model(project / "models" / run)
    assert not (project / f"checkpoints/rl/{run}").exists()


def test_seen_grpo_on_two_processes(project):
    """Seen here; Unseen on two processes is the killed-and-resumed run below."""
    launch(project, "stages.rl", "rl_gsm8k_seen")
    assert_two_process_run(project, "rl_gsm8k_seen", steps=2)
    runs = mlflow_runs(project)
    assert len(runs) == 1 and runs[0].data.tags["stage"] == "rl"  # rank 1 opened none


def test_killed_two_process_grpo_resumes_from_its_last_checkpoint(project):
    run = "parallel_r1_unseen_parallel_only"
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["rl_datasets"]["dapo"]["max_steps"] = 4
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    checkpoints = project / "checkpoints/rl" / run
    process = subprocess.Popen(launch_command("stages.rl", run), cwd=project, env=launch_env(project),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while last_complete_checkpoint(checkpoints)[0] is None:
        assert process.poll() is None and time.monotonic() < deadline, "no checkpoint before the run ended"
        time.sleep(0.2)
    kill_with_workers(process)
    assert not (project / "models" / run).exists()

    launch(project, "stages.rl", run)
    assert_two_process_run(project, run, steps=4)
    runtime = read_json(project / f"metrics/runtime/rl/{run}.json")
    assert (runtime["resumed_from"] or "").startswith(f"checkpoints/rl/{run}/checkpoint-")
    assert 0 < runtime["steps_this_run"] < 4
    runs = mlflow_runs(project)
    assert len(runs) == 2 and {r.data.tags["stage"] for r in runs} == {"rl"}  # one per launch: rank 0's


def test_unseen_sft_on_two_processes(project, mirror):
    """Unseen, whose collator adds the structured masks and positions; Seen's plain batches go through the
    same two-process path (accumulation over both ranks, rank 0's outputs) and are tested on one."""
    variant = "unseen"
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["sft"] = {**SFT_PARAMS, "batch_size": 2, "per_device_batch_size": 1}
    params["sft_variants"] = {"seen": {"max_steps": 2}, "unseen": {"max_steps": 2}}
    params["data"]["mirror_dir"] = str(mirror)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    rows = [row for row in load_teacher_demos(mirror, limit=40) if check_format(row["completion"])][:4]
    write_jsonl(project / "data/sft/demos.jsonl", rows)
    launch(project, "stages.sft", variant, "--data", "data/sft/demos.jsonl")
    summary = read_json(project / f"metrics/sft/{variant}/summary.json")
    assert summary["processes"] == 2 and summary["steps"] == 2 and summary["examples"] == 4
    assert len(read_json(project / f"metrics/sft/{variant}/loss.json")) == 2
    load_model(project / f"models/sft_{variant}")
    runs = mlflow_runs(project)
    assert len(runs) == 1 and runs[0].data.tags["stage"] == "sft"
