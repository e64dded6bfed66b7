"""MLflow tracking: stage runs nest under their flow's run, with params, tags and metrics;
tracking off or unreachable never stops a stage; model references log a DVC hash, not weights."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient
from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

from flows import ui
from parallel_r1 import mlflow_ui, tracking
from parallel_r1.errors import PipelineError
from parallel_r1.reward_schedule_report import METRICS, SCHEDULES, build_report

PARAMS = {"profile": "tiny", "seed": 42, "rl": {"lr": 1e-6}, "rl_datasets": {"gsm8k": {"max_steps": 2}},
          "tracking": {"experiment": "tracking-test"}}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow server on 127.0.0.1 (sqlite in tmp), stopped after the module."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    service = ui.start("MLflow server", ui.mlflow_server_command(port, root), ui.mlflow_server_env(root),
                       root, f"http://127.0.0.1:{port}/health", root / "server.log")
    try:
        ui.wait_healthy(service, timeout=240)
        yield f"http://127.0.0.1:{port}"
    finally:
        ui.stop([service])


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory) -> str:
    """One sqlite store for the module (creating its tables takes seconds); tests use own experiments."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow-local') / 'mlflow.db'}"


@pytest.fixture
def local_store(sqlite_store, tmp_path, monkeypatch, request):
    """Tracking into the module's sqlite file, in an experiment of this test's own; no DVC or
    parent env leaking in; cwd = tmp_path."""
    for name in ("DVC_STAGE", "DVC_EXP_NAME", "DVC_ROOT", tracking.PARENT_ENV, tracking.SWITCH_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_store)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", request.node.name)
    monkeypatch.chdir(tmp_path)
    return sqlite_store


def test_params_flatten_to_dotted_keys_and_long_values_are_cut():
    flat = tracking.flatten_params({"rl": {"lr": 1e-6, "datasets": {"gsm8k": {"limit": None}}},
                                    "evaluate": {"benchmarks": ["aime24", "amc23"]}, "note": "x" * 7000})
    assert flat["rl.lr"] == "1e-06"
    assert flat["rl.datasets.gsm8k.limit"] == "null"
    assert json.loads(flat["evaluate.benchmarks"]) == ["aime24", "amc23"]
    assert len(flat["note"]) == MAX_PARAM_VAL_LENGTH and flat["note"].endswith("...")


def test_relative_sqlite_uri_resolves_against_the_dvc_root(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    assert tracking.tracking_uri({"tracking": {"tracking_uri": "sqlite:///mlflow.db"}}) == \
        f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"


def test_tracking_off_makes_every_call_a_no_op(local_store, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv(tracking.SWITCH_ENV, "off")
    with tracking.stage_run("sft", "seen", PARAMS) as run_id:
        assert run_id is None
        assert tracking.report_to() == "none"
        tracking.log_metrics({"loss": 1.0}, step=1)
    assert not (tmp_path / "mlflow.db").exists()


def test_unreachable_server_warns_once_and_the_stage_goes_on(local_store, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    ran = []
    with (caplog.at_level(logging.WARNING, logger="parallel_r1.tracking"),
          tracking.stage_run("sft", "seen", PARAMS) as run_id):
        tracking.log_metrics({"loss": 1.0})
        ran.append(tracking.report_to())
    assert run_id is None and ran == ["none"]
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "continuing without MLflow" in warnings[0] and "\n" not in warnings[0]


def test_stage_failure_ends_the_run_failed_and_the_error_goes_on(local_store):
    with pytest.raises(PipelineError, match="bad row"), tracking.stage_run("filter", params=PARAMS) as run_id:
        raise PipelineError("data/x.jsonl row 3: bad row")
    run = MlflowClient(local_store).get_run(run_id)
    assert run.info.status == "FAILED" and run.info.run_name == "filter"


@pytest.mark.parametrize(("error", "status"), [(SystemExit(0), "FINISHED"), (SystemExit(1), "FAILED"),
                                               (KeyboardInterrupt(), "KILLED")])
def test_stage_and_parent_runs_end_with_the_status_of_how_the_block_left(local_store, error, status):
    for run_context in (tracking.stage_run("validate", params=PARAMS),
                        tracking.parent_run("flow", params=PARAMS)):
        with pytest.raises(type(error)), run_context as run_id:
            raise error
        assert MlflowClient(local_store).get_run(run_id).info.status == status


@pytest.mark.server
@pytest.mark.slow
def test_stage_run_lands_on_the_server_under_its_parent_with_params_tags_and_metrics(mlflow_server,
                                                                                      local_store,
                                                                                      monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME")  # params tracking.experiment decides
    with tracking.parent_run("reproduce@all", params={"tracking": PARAMS["tracking"]}) as parent_id:
        env = tracking.child_env(parent_id)
        monkeypatch.setenv(tracking.PARENT_ENV, env[tracking.PARENT_ENV])
        monkeypatch.setenv("DVC_STAGE", "rl@grpo_dapo")
        monkeypatch.setenv("DVC_EXP_NAME", "sweep-1-grpo_dapo")
        with tracking.stage_run("rl", "grpo_dapo", PARAMS, {tracking.TAG_REWARD_SCHEDULE: "alternating",
                                                            tracking.TAG_VARIANT: "unseen"}) as run_id:
            assert tracking.report_to() == "mlflow"
            for step, reward in enumerate((0.1, 0.4), start=1):
                tracking.log_metrics({"reward": reward}, step=step)
            (Path("table.md")).write_text("| a |\n")
            tracking.log_artifact("table.md")
    assert env["MLFLOW_TRACKING_URI"] == mlflow_server
    client = MlflowClient(mlflow_server)
    run = client.get_run(run_id)
    assert run.info.run_name == "rl@grpo_dapo" and run.info.status == "FINISHED"
    assert run.data.tags["mlflow.parentRunId"] == parent_id
    assert run.data.params["rl.lr"] == "1e-06" and run.data.params["rl_datasets.gsm8k.max_steps"] == "2"
    tags = run.data.tags
    assert (tags["dvc_stage"], tags["dvc_exp_name"], tags["profile"]) == ("rl@grpo_dapo", "sweep-1-grpo_dapo",
                                                                          "tiny")
    assert (tags["reward_schedule"], tags["variant"]) == ("alternating", "unseen")
    assert tags["params_hash"] == tracking.params_hash(PARAMS) and "git_commit" in tags
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward")] == [(1, 0.1), (2, 0.4)]
    assert client.get_experiment(run.info.experiment_id).name == "tracking-test"
    assert [artifact.path for artifact in client.list_artifacts(run_id)] == ["table.md"]


@pytest.mark.slow
def test_trainer_mlflow_callback_logs_into_the_stage_run(local_store, monkeypatch):
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from transformers.integrations import MLflowCallback

    monkeypatch.setenv("MLFLOW_RUN_ID", "0" * 32)  # would make the callback resume another run
    monkeypatch.setenv("MLFLOW_NESTED_RUN", "true")  # would make it open a child run
    with tracking.stage_run("sft", "seen", PARAMS) as run_id:
        args = TrainingArguments(output_dir="out", report_to="none", seed=PARAMS["seed"])
        state, callback = TrainerState(), MLflowCallback()
        callback.on_train_begin(args, state, TrainerControl())
        for step in (1, 2):
            state.global_step = step
            callback.on_log(args, state, TrainerControl(), logs={"loss": 1.0 / step})
        callback.on_train_end(args, state, TrainerControl())
        import mlflow

        assert mlflow.active_run().info.run_id == run_id  # the callback did not end our run
    client = MlflowClient(local_store)
    runs = client.search_runs([client.get_experiment_by_name(tracking.experiment_name()).experiment_id])
    assert [run.info.run_id for run in runs] == [run_id]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(1, 1.0), (2, 0.5)]
    assert runs[0].data.params["learning_rate"] == str(args.learning_rate)  # the Trainer's own params too


def test_model_reference_logs_a_dvc_md5_that_matches_dvc_add(local_store, tmp_path):
    model = tmp_path / "models" / "sft_seen"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text('{"a": 1}\n')
    (model / "sub" / "weights.bin").write_bytes(bytes(range(256)) * 64)
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "add", "-q", "models/sft_seen"], cwd=tmp_path, check=True)
    dvc_md5 = yaml.safe_load((tmp_path / "models" / "sft_seen.dvc").read_text())["outs"][0]["md5"]
    with tracking.stage_run("sft", "seen", PARAMS) as run_id:
        tags = tracking.log_model_reference("models/sft_seen")
    assert tags["model.sft_seen.md5"] == dvc_md5 and tags["model.sft_seen.md5_source"] == "computed"
    run = MlflowClient(local_store).get_run(run_id)
    assert run.data.tags["model.sft_seen.path"] == "models/sft_seen"
    assert not MlflowClient(local_store).list_artifacts(run_id)  # no weights copied


def test_model_reference_reads_an_upstream_stage_hash_from_dvc_lock(local_store, tmp_path, monkeypatch):
    (tmp_path / "models" / "base").mkdir(parents=True)
    (tmp_path / "models" / "base" / "config.json").write_text("{}")
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\nstages:\n  prepare_model:\n    outs:\n"
                                       "    - path: models/base\n      md5: 0123456789abcdef.dir\n")
    monkeypatch.setenv("DVC_STAGE", "sft@seen")
    tags = tracking.log_model_reference(tmp_path / "models" / "base")
    assert (tags["model.base.md5"], tags["model.base.md5_source"]) == ("0123456789abcdef.dir", "dvc.lock")
    monkeypatch.setenv("DVC_STAGE", "prepare_model")  # a stage's own output: dvc.lock is stale
    assert tracking.log_model_reference(tmp_path / "models" / "base")["model.base.md5_source"] == "computed"


def test_reward_schedule_report_compares_schedules_over_steps(local_store, tmp_path, monkeypatch):
    monkeypatch.delenv(mlflow_ui.PORT_ENV, raising=False)
    curves = [("accuracy", [0.9]), ("accuracy", [0.2, 0.3, 0.5]), ("alternating", [0.1, 0.4, 0.6])]
    for schedule, accuracy in curves:  # the first accuracy run is replaced by its rerun
        with tracking.stage_run("rl", f"run_{schedule}", PARAMS, {tracking.TAG_REWARD_SCHEDULE: schedule}):
            for step, value in enumerate(accuracy, start=1):
                tracking.log_metrics({METRICS["accuracy"]: value, METRICS["reward"]: 2 * value,
                                      METRICS["parallel_ratio"]: 0.5 if schedule == "alternating" else 0.0},
                                     step=step)
    with tracking.stage_run("sft", "seen", PARAMS, {tracking.TAG_REWARD_SCHEDULE: "accuracy"}):
        tracking.log_metrics({"accuracy": 0.99})  # not an RL run: must not show
    runs = build_report(tmp_path / "reports" / "reward_schedules.md",
                        tmp_path / "reports" / "reward_schedules.png", params=PARAMS)
    assert [(run.schedule, run.curves["accuracy"]) for run in runs] == [
        ("accuracy", [(1, 0.2), (2, 0.3), (3, 0.5)]), ("alternating", [(1, 0.1), (2, 0.4), (3, 0.6)])]
    text = (tmp_path / "reports" / "reward_schedules.md").read_text()
    row = next(line for line in text.splitlines() if "rl@run_alternating" in line)
    alternating = runs[1]
    experiment = MlflowClient(local_store).get_experiment_by_name(tracking.experiment_name()).experiment_id
    assert alternating.url == (f"http://127.0.0.1:5000/#/experiments/{experiment}/runs/{alternating.run_id}"
                               "?workflowType=machine_learning")  # the page on `make ui`'s MLflow server
    assert row.split(" | ")[:4] == ["| " + SCHEDULES["alternating"],
                                    f"[rl@run_alternating]({alternating.url})", "3", "0.200 → 1.200"]
    assert ("none listed): parallel-only, parallel + diversity (beyond the paper's tables), scaffold"
            in text)
    assert (tmp_path / "reports" / "reward_schedules.png").read_bytes()[:4] == b"\x89PNG"


def test_reward_schedule_report_without_rl_runs_says_so_in_one_line(local_store, capsys):
    from parallel_r1.reward_schedule_report import main

    with tracking.stage_run("sft", "seen", PARAMS):
        pass
    with pytest.raises(PipelineError, match=r"^MLflow .*no finished 'rl' runs tagged reward_schedule") as err:
        build_report("r.md", "r.png", params=PARAMS)
    assert "\n" not in str(err.value)
    with pytest.raises(SystemExit) as stopped:   # as a user runs it
        main(["--out", "reports/r.md"])
    assert stopped.value.code == 1 and capsys.readouterr().err.count("\n") == 1
    assert not Path("reports/r.md").exists()
