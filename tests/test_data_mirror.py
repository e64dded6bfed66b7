"""The data mirror is a DVC dependency: every stage that reads it depends on exactly the files it reads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import copy_repo
from parallel_r1.data import SOURCES, TEACHER_DEMOS, mirror_files
from stages.common import link_mirror_for_temp_experiments
from stages.profiles import compose, profile_names
from stages.sft import PROBE_SET

REPO = Path(__file__).resolve().parents[1]


def mirror_deps() -> dict[str, set[str]]:
    """{stage address: the deps under data.mirror_dir, relative to it}, as DVC resolves dvc.yaml."""
    from dvc.repo import Repo

    mirror = yaml.safe_load((REPO / "params.yaml").read_text())["data"]["mirror_dir"].rstrip("/") + "/"
    with Repo(str(REPO)) as repo:
        return {stage.addressing: {d.def_path[len(mirror):] for d in stage.deps
                                   if d.def_path.startswith(mirror)}
                for stage in repo.index.stages}


def files_read(params: dict) -> dict[str, set[str]]:
    """The mirror files each stage reads under `params` (one profile), from the code's own tables."""
    data, generate = params["data"], params["generate_datasets"]
    reads = {"prepare_data": {file for group in ("rl", "eval") for spec in data[group].values()
                              for file in mirror_files(spec["source"])}}
    for name, spec in generate.items():
        reads[f"generate@{name}"] = ({TEACHER_DEMOS.mirror_file} if spec["source"] == "released"
                                     else {SOURCES[spec["problems"]].mirror_file})
    for variant in ("seen", "unseen"):
        reads[f"sft@{variant}"] = {SOURCES[PROBE_SET].mirror_file}
    return reads


def test_stages_depend_on_exactly_the_mirror_files_they_read():
    declared = mirror_deps()
    expected: dict[str, set[str]] = {}
    for profile in profile_names(REPO):   # DVC cannot switch deps per profile: the union over all of them
        for stage, files in files_read(compose(REPO, profile)).items():
            expected.setdefault(stage, set()).update(files)
    assert {stage: files for stage, files in declared.items() if files} == expected


def dvc(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PARALLEL_R1_TRACKING": "off"}
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=env, capture_output=True,
                          text=True)


def test_mirror_edit_makes_dvc_status_report_the_stage(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    mirror = repo / "mirror"                     # every profile's data.mirror_dir (git-ignored)
    for name in mirror_deps()["prepare_data"]:   # every file it declares (the profiles' union), as DVC needs
        (mirror / name).parent.mkdir(parents=True, exist_ok=True)
        (mirror / name).write_text('{"id": "1", "question": "q", "problem": "q", "ground_truth": "1"}\n')
    for out in ("data/rl", "data/eval"):
        (repo / out).mkdir(parents=True)
        (repo / out / "x.jsonl").write_text("{}\n")
    committed = dvc(repo, "commit", "--force", "prepare_data")   # record today's hashes, as a repro would
    assert committed.returncode == 0, committed.stderr
    assert "prepare_data" not in dvc(repo, "status", "prepare_data").stdout

    with open(mirror / "eval" / "aime24.jsonl", "a", encoding="utf-8") as handle:
        handle.write('{"id": "2", "problem": "new", "ground_truth": "2"}\n')
    status = dvc(repo, "status", "prepare_data").stdout
    assert "prepare_data:" in status and "modified:           mirror/eval/aime24.jsonl" in status


def test_relative_mirror_resolves_inside_a_temp_experiment(tmp_path):
    root, mirror = tmp_path / "project", tmp_path / "shared" / "data"
    (root / ".dvc").mkdir(parents=True)
    mirror.mkdir(parents=True)
    (mirror / "x.jsonl").write_text("{}\n")
    link_mirror_for_temp_experiments(root, "../shared/data")
    experiment = root / ".dvc" / "tmp" / "exps" / "standalone" / "tmpabc123"   # where DVC runs --temp
    experiment.mkdir()
    assert (experiment / "../shared/data/x.jsonl").read_text() == "{}\n"
    link_mirror_for_temp_experiments(root, "../shared/data")                   # idempotent
