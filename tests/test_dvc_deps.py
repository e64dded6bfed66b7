"""dvc.yaml tells the truth: every stage lists the project code it imports and only the params it reads.

Code: each stage module's imports are walked (ast, transitively, within the project); a stage whose deps
miss one fails, and so does one that lists code it never imports. Params: the per-item sections
(reward_schedules, rl_datasets, generate_datasets) have an entry for every item in every profile, and the
slow tests change one knob in a copy of the repo whose outputs are placeholders committed to dvc.lock
(`dvc commit -f`: nothing is trained) and check with `dvc status` that only the stages reading it are stale.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, copy_repo, set_param
from parallel_r1.errors import PipelineError

# Imported by stages but unable to change an output: the error type, and MLflow tracking (which
# watches from the side; its own tests pin it). Everything else a stage imports is a dependency.
CANNOT_CHANGE_OUTPUTS = {"parallel_r1/errors.py", "parallel_r1/tracking.py", "parallel_r1/mlflow_ui.py"}


def dvc(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PARALLEL_R1_TRACKING": "off"}
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=env, capture_output=True,
                          text=True)


def module_file(name: str) -> Path | None:
    """The project file of dotted module `name` (a package's __init__.py), None outside the project."""
    base = REPO.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: Path) -> set[str]:
    """Dotted names a module imports anywhere in its body (deferred imports inside functions count)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return names


def project_imports(module: str, skip: set[str] | frozenset[str] = frozenset()) -> set[str]:
    """Repo-relative files that `module` imports, transitively, itself included (packages' __init__ too).

    The walk does not enter `skip`: what only tracking imports cannot change an output either.
    """
    seen: set[str] = set(skip)
    todo = [module]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__ too
            path = module_file(".".join(parts[:depth]))
            if path is None:
                continue
            rel = path.relative_to(REPO).as_posix()
            if rel not in seen:
                seen.add(rel)
                todo.extend(imported_modules(path))
    return seen - set(skip)


def stage_definitions() -> dict[str, dict]:
    """dvc.yaml's stages as DVC resolves them (foreach expanded), name -> {cmd, deps, params}."""
    from dvc.repo import Repo

    with Repo(str(REPO)) as repo:
        return {stage.addressing: {"cmd": stage.cmd, "deps": [dep.def_path for dep in stage.deps
                                                             if not dep.def_path.endswith("params.yaml")]}
                for stage in repo.index.stages}


def covered(path: str, deps: list[str]) -> bool:
    return any(path == dep or path.startswith(dep.rstrip("/") + "/") for dep in deps)


def needed_code(stage: dict) -> set[str]:
    module = stage["cmd"].split("python -m ", 1)[1].split()[0]
    return project_imports(module, CANNOT_CHANGE_OUTPUTS) - {"stages/__init__.py", "parallel_r1/__init__.py"}


def test_every_stage_lists_the_project_code_it_imports():
    missing = {}
    for name, stage in stage_definitions().items():
        gaps = sorted(path for path in needed_code(stage) if not covered(path, stage["deps"]))
        if gaps:
            missing[name] = gaps
    assert not missing, "dvc.yaml deps miss imported project code:\n" + "\n".join(
        f"  {name}: {', '.join(gaps)}" for name, gaps in sorted(missing.items()))


def test_no_stage_lists_project_code_it_does_not_import():
    extra = {}
    for name, stage in stage_definitions().items():
        needed = needed_code(stage)
        code = [dep for dep in stage["deps"] if dep.startswith(("stages/", "parallel_r1/"))]
        unused = sorted(dep for dep in code if not any(covered(path, [dep]) for path in needed))
        if unused:
            extra[name] = unused
    assert not extra, "dvc.yaml deps name code the stage never imports:\n" + "\n".join(
        f"  {name}: {', '.join(deps)}" for name, deps in sorted(extra.items()))


# ---------------------------------------------------------------- params: what a knob makes stale


def outs_and_deps(repo: Path) -> tuple[list[str], list[str]]:
    """Every output path of dvc.yaml, and every dependency path (params files left out)."""
    from dvc.repo import Repo

    with Repo(str(repo)) as dvc_repo:
        stages = dvc_repo.index.stages
        outs = {out.def_path for stage in stages for out in stage.outs}
        deps = {dep.def_path for stage in stages for dep in stage.deps
                if not dep.def_path.endswith("params.yaml")}
    return sorted(outs), sorted(deps)


def lock_with_placeholders(repo: Path) -> None:
    """Every output a placeholder, then `dvc commit -f`: a dvc.lock as after a full `dvc repro`, in seconds.

    `dvc status` compares deps and params against the lock, never reruns anything, so placeholder
    outputs are enough to see which stages a change would rebuild.
    """
    outs, deps = outs_and_deps(repo)
    for name in [*outs, *deps]:  # deps inside an output folder (data/rl/gsm8k.jsonl) are files in it
        path = repo / name
        if path.exists():
            continue
        if path.suffix:  # a file (x.json, x.md, x.png, x.jsonl)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"placeholder {name}\n")
        else:
            path.mkdir(parents=True)
            (path / "placeholder.txt").write_text(f"placeholder {name}\n")
    result = dvc(repo, "commit", "-f")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def stale_stages(repo: Path) -> set[str]:
    result = dvc(repo, "status", "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return set(json.loads(result.stdout or "{}"))


def edit_profile(repo: Path, old: str, new: str) -> None:
    """One text edit of the copy's conf/profile/tiny.yaml, composed into params.yaml as a user would."""
    from stages.profiles import switch

    profile_file = repo / "conf" / "profile" / "tiny.yaml"
    text = profile_file.read_text()
    assert text.count(old) == 1, old
    profile_file.write_text(text.replace(old, new))
    switch(repo, "tiny", force=True)


def test_each_reward_schedule_has_its_own_knobs_in_every_profile():
    from parallel_r1.rewards import REWARDS, SCHEDULE_KNOBS, SHARED_KNOBS
    from stages.profiles import compose, profile_names

    for name in profile_names(REPO):  # DVC needs every key a stage can name, in every profile
        params = compose(REPO, name)
        assert set(params["rewards"]) == set(SHARED_KNOBS), name
        assert {schedule: set(knobs) for schedule, knobs in params["reward_schedules"].items()} == \
            {schedule: set(SCHEDULE_KNOBS[schedule]) for schedule in REWARDS}, name
        assert set(params["rl_datasets"]) == {"gsm8k", "dapo"}, name
        assert set(params["generate_datasets"]) == {"gsm8k", "dapo"}, name


@pytest.fixture(scope="module")
def locked_repo(tmp_path_factory, mirror):
    repo = copy_repo(tmp_path_factory.mktemp("locked"), mirror)
    lock_with_placeholders(repo)
    assert stale_stages(repo) == set()
    return repo


@pytest.fixture
def params_restored(locked_repo):
    files = [locked_repo / "params.yaml", locked_repo / "conf" / "profile" / "tiny.yaml"]
    originals = [path.read_text() for path in files]
    yield yaml.safe_load(originals[0])
    for path, text in zip(files, originals, strict=False):
        path.write_text(text)


def runs(params: dict, **where: str) -> set[str]:
    return {f"rl@{run}" for run, entry in params["rl_runs"].items()
            if all(entry[key] in values.split("|") for key, values in where.items())}


@pytest.mark.slow
def test_bytecode_written_into_code_folders_leaves_every_stage_up_to_date(locked_repo):
    """Python caches bytecode beside the sources it imports (unless PYTHONDONTWRITEBYTECODE is set); the
    RL stages depend on the whole parallel_r1/engine folder, so .dvcignore keeps those caches out of it."""
    caches = [locked_repo / "parallel_r1/engine/__pycache__", locked_repo / "stages/__pycache__"]
    for folder in caches:
        folder.mkdir()
        (folder / "hf.cpython-311.pyc").write_bytes(b"\x00bytecode")
    (locked_repo / "parallel_r1/engine/loop.pyc").write_bytes(b"\x00bytecode")  # compileall -b's legacy place
    try:
        assert stale_stages(locked_repo) == set()
    finally:
        for folder in caches:
            shutil.rmtree(folder)
        (locked_repo / "parallel_r1/engine/loop.pyc").unlink()


@pytest.mark.slow
def test_an_s2_knob_makes_only_the_s2_and_scaffold_runs_stale(locked_repo, params_restored):
    # the tiny profile's S2 window; the scaffold run takes S2's knobs through the YAML merge in conf/
    edit_profile(locked_repo, "alternating: &s2\n    <<: *tiered\n    window: 2",
                 "alternating: &s2\n    <<: *tiered\n    window: 3")
    expected = runs(params_restored, reward="alternating|scaffold")
    assert expected == {"rl@parallel_r1_unseen_s2", "rl@scaffold"}
    # scaffold_curve reads the switch step only (it reruns after rl@scaffold, through models/scaffold)
    assert stale_stages(locked_repo) == expected


@pytest.mark.slow
def test_a_dataset_step_count_makes_only_that_datasets_runs_stale(locked_repo, params_restored):
    set_param(locked_repo / "params.yaml", "rl_datasets.gsm8k.max_steps", "5")
    assert stale_stages(locked_repo) == runs(params_restored, dataset="gsm8k")


@pytest.mark.slow
def test_an_evaluation_k_makes_only_evaluations_stale(locked_repo, params_restored):
    set_param(locked_repo / "params.yaml", "evaluate.benchmarks.aime25.k", "8")
    expected = {f"evaluate@{model}" for model in params_restored["evaluate"]["models"]} | {"scaffold_curve"}
    assert stale_stages(locked_repo) == expected


@pytest.mark.slow
def test_one_sft_variants_step_count_makes_only_that_variant_stale(locked_repo, params_restored):
    set_param(locked_repo / "params.yaml", "sft_variants.unseen.max_steps", "5")
    assert stale_stages(locked_repo) == {"sft@unseen"}


@pytest.mark.slow
def test_an_rl_rollout_setting_retrains_the_runs_but_does_not_touch_the_evaluations(locked_repo,
                                                                                     params_restored):
    # evaluate reads its own num_paths / max_blocks (interpolated from rl's in conf/), not the rl section
    set_param(locked_repo / "params.yaml", "rl.max_completion_tokens", "40")
    assert stale_stages(locked_repo) == runs(params_restored)


def test_an_rl_run_reads_only_its_schedules_knobs():
    from stages.profiles import compose
    from stages.rl import reward_config

    params = compose(REPO, "paper")
    assert reward_config(params, "alternating").window == 10
    assert reward_config(params, "scaffold").switch_step == 200
    params["reward_schedules"]["accuracy"] = {"window": 3}   # accuracy never reads a window
    with pytest.raises(PipelineError, match=r"^params.yaml reward_schedules.accuracy: unknown key 'window' "):
        reward_config(params, "accuracy")


def test_the_evaluations_list_every_top_level_evaluate_setting():
    # evaluate@<model>, evaluate_init@<run> and scaffold_curve read the `evaluate` section key by key (the
    # model and init lists aside): a key left out of their params (as max_batch_size was) changes the samples
    # without making them stale
    section = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))["evaluate"]
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    for name in ("evaluate", "evaluate_init", "scaffold_curve"):
        definition = stages[name].get("do", stages[name])
        listed = {param.split(".", 1)[1] for param in definition["params"] if param.startswith("evaluate.")}
        assert set(section) - {"models", "inits"} <= listed, name


def test_evaluation_takes_the_rollout_mode_from_the_model_folder(tmp_path, monkeypatch):
    from parallel_r1.io import write_json
    from stages.evaluate import rollout_mode

    monkeypatch.chdir(tmp_path)
    write_json("models/ablation/rollout.json", {"prompt": "baseline", "variant": "unseen", "parallel": False})
    assert rollout_mode("ablation") == ("baseline", True, False)
    assert rollout_mode("sft_unseen") == ("parallel", True, True)


@pytest.mark.slow
def test_a_teacher_set_limit_makes_only_that_sets_generation_stale(locked_repo, params_restored):
    set_param(locked_repo / "params.yaml", "generate_datasets.dapo.limit", "4")
    # filter reads every set's entry (names, sources); it also reads data/teacher/dapo.jsonl, so it reruns
    # anyway
    assert stale_stages(locked_repo) == {"generate@dapo", "filter"}


def declared_deps(stage: str) -> set[str]:
    """The deps of one stage of dvc.yaml as written (no interpolation: report stages name paths)."""
    return set(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"][stage]["deps"])


@pytest.mark.parametrize("profile", ["small", "tiny", "paper"])
def test_report_stages_depend_on_the_runs_their_params_name(profile):
    """reward_schedules reads the step and summary files of reports.reward_schedule_runs: a run a profile adds
    there must be a dep; heldout and the tables read what the profile evaluates."""
    from parallel_r1.config import from_mapping
    from parallel_r1.reports import ReportOptions
    from stages.profiles import compose

    params = compose(REPO, profile)
    options = from_mapping(ReportOptions, params.get("reports", {}), "reports")
    # heldout reads the samples of each run of reports.heldout_runs and of its init (its evaluation as the
    # run samples, <run>.init, for a run of evaluate.inits) and how each was sampled: all of data/samples and
    # metrics/eval, and those evaluations must be the profile's
    inits = set(params["evaluate"].get("inits") or [])
    read = {model for run in options.heldout_runs
            for model in (run, f"{run}.init" if run in inits else params["rl_runs"][run]["init"])}
    assert {"data/samples", "metrics/eval"} <= declared_deps("heldout"), declared_deps("heldout")
    evaluated = set(params["evaluate"]["models"]) | {f"{run}.init" for run in inits}
    assert read <= evaluated, read - evaluated
    read = {f"metrics/rl/{run}/{name}" for run in options.reward_schedule_runs
            for name in ("steps.json", "summary.json")}
    assert read <= declared_deps("reward_schedules"), read - declared_deps("reward_schedules")
    # the tables read the metrics of their rows' models that evaluate.models lists (the rest read "not
    # evaluated"): all of metrics/eval, and the list itself, so a profile that evaluates more rebuilds them
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for table in ("table2", "ablation_training", "ablation_prompt", "ablation_reward"):
        assert "metrics/eval" in declared_deps(table) and "evaluate.models" in stages[table]["params"], table


def test_every_stage_that_reads_validated_data_runs_after_validate():
    """A row `validate` rejects must stop the stages that read it: they depend on its report (issue:
    evaluation could run on data/eval rows that validation had failed)."""
    import networkx as nx
    from dvc.repo import Repo

    with Repo(str(REPO)) as repo:
        graph = repo.index.graph   # edges point from a stage to the stages it depends on
        stages = {stage.addressing: stage for stage in graph.nodes}
        readers = [name for name, stage in stages.items()
                   if any(dep.def_path.startswith(("data/eval", "data/rl", "data/sft"))
                          for dep in stage.deps)]
        validate = stages["validate"]
        late = [name for name in readers if name != "validate" and
                validate not in nx.descendants(graph, stages[name])]
    assert readers and not late, late


@pytest.mark.parametrize("profile", ["small", "tiny", "paper"])
def test_every_dependency_exists_or_is_written_by_a_stage_of_the_profile(profile, tmp_path, mirror):
    """A dep named for another profile's runs (heldout's data/samples/<run>, when the small profile stopped
    evaluating one) made `dvc repro` fail at the last stage with `No such file or directory`."""
    from dvc.dependency.param import ParamsDependency
    from dvc.repo import Repo

    copy = copy_repo(tmp_path / "repo", mirror, profile)
    with Repo(str(copy)) as repo:
        stages = list(repo.index.stages)
        outs = [Path(out.fs_path) for stage in stages for out in stage.outs]
        missing = [f"{stage.addressing}: {dep.def_path}" for stage in stages for dep in stage.deps
                   if not isinstance(dep, ParamsDependency) and not Path(dep.fs_path).exists()
                   and not any(Path(dep.fs_path) == out or Path(dep.fs_path) in out.parents
                               or out in Path(dep.fs_path).parents for out in outs)]
    assert not missing, missing
