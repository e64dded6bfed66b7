"""The evaluate stage end to end on a tiny model: 2 problems per benchmark, real engine and scoring."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from parallel_r1.models import TinyModelConfig, prepare_base_model

REPO = Path(__file__).resolve().parents[1]
SMALL = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16)
BENCHMARKS = ("aime24", "aime25", "amc23", "math")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, mirror):
    root = tmp_path_factory.mktemp("evaluate")
    params = (REPO / "params.yaml").read_text().replace("mirror_dir: ../shared/data", f"mirror_dir: {mirror}")
    params = re.sub(r"^profile: \w+", "profile: tiny", params, count=1, flags=re.M)  # the fast random-init model
    (root / "params.yaml").write_text(params.replace("      max_tokens: 64\n      benchmarks:", "      max_tokens: 24\n      benchmarks:"))
    prepare_base_model("tiny", root / "models" / "base", tiny=SMALL)
    return root


@pytest.fixture
def inside(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("PARALLEL_R1_TRACKING", "off")
    from stages.prepare_data import main as prepare_data

    prepare_data()
    return workdir


def test_tiny_model_on_every_benchmark(inside):
    from stages.evaluate import main

    main(["base"])
    for benchmark in BENCHMARKS:
        metrics = json.loads((inside / "metrics/eval/base" / f"{benchmark}.json").read_text())
        k = 1 if benchmark == "math" else 2
        assert (metrics["k"], metrics["n_problems"], metrics["n_samples"]) == (k, 2, 2 * k)
        assert 0.0 <= metrics["mean_at_k"] <= metrics["pass_at_k"] <= 1.0
        assert metrics["profile"] == "tiny" and metrics["position_unit"] == "tokens"
        rows = [json.loads(line) for line in (inside / "data/samples/base" / f"{benchmark}.jsonl").open()]
        assert len(rows) == 2 * k
        # A random model rambles to the cap: truncated generations are scored and counted, not dropped.
        assert metrics["truncated"] == sum(row["truncated"] for row in rows)
        assert all(row["completion_tokens"] <= 24 for row in rows)


def test_evaluation_is_an_mlflow_run_with_every_benchmark_metric(inside, monkeypatch):
    from mlflow import MlflowClient

    from stages.evaluate import main

    uri = f"sqlite:///{inside / 'mlflow.db'}"
    monkeypatch.setenv("PARALLEL_R1_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "evaluate-test")
    main(["base"])
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("evaluate-test").experiment_id])
    assert (run.info.run_name, run.info.status) == ("evaluate@base", "FINISHED")
    assert run.data.tags["variant"] == "seen" and run.data.tags["model.base.md5"].endswith(".dir")
    for benchmark in BENCHMARKS:
        metrics = json.loads((inside / "metrics/eval/base" / f"{benchmark}.json").read_text())
        assert run.data.metrics[f"{benchmark}.mean_at_k"] == metrics["mean_at_k"]
        assert run.data.metrics[f"{benchmark}.truncated"] == metrics["truncated"]


def test_missing_checkpoint_is_one_line(inside, capsys):
    from stages.evaluate import main

    with pytest.raises(SystemExit):
        main(["grpo_dapo"])
    assert capsys.readouterr().err.strip() == "error: models/grpo_dapo: model folder not found (did its stage run?)"


def test_benchmark_without_answers_is_one_line(inside, capsys):
    from stages.evaluate import main

    path = inside / "data/eval/amc23.jsonl"
    rows = [json.loads(line) for line in path.open()]
    rows[1]["ground_truth"] = ""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(SystemExit):
        main(["base"])
    assert capsys.readouterr().err.strip() == "error: data/eval/amc23.jsonl:2: missing field(s) ground_truth"


def test_corrupt_checkpoint_is_one_line(inside, capsys):
    from stages.evaluate import main

    shutil.copytree(inside / "models/base", inside / "models/sft_seen")
    (inside / "models/sft_seen/model.safetensors").unlink()
    with pytest.raises(SystemExit):
        main(["sft_seen"])
    assert "models/sft_seen: no weights" in capsys.readouterr().err
