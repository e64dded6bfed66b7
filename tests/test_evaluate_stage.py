"""The evaluate stage end to end on a tiny model: 2 problems per benchmark, real engine and scoring."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import set_param, write_profile_params
from parallel_r1.models import TinyModelConfig, prepare_base_model

REPO = Path(__file__).resolve().parents[1]
SMALL = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16)
BENCHMARKS = ("aime24", "aime25", "amc23", "math")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, mirror):
    root = tmp_path_factory.mktemp("evaluate")
    params = write_profile_params(root, "tiny", mirror)  # the fast random-init model
    set_param(params, "evaluate.max_tokens", "24")
    prepare_base_model("tiny", root / "models" / "base", tiny=SMALL)
    return root


@pytest.fixture
def inside(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("PARALLEL_R1_TRACKING", "off")
    shutil.rmtree(workdir / "data/memo", ignore_errors=True)  # each test starts engines; the memo has its own
    from stages.prepare_data import main as prepare_data

    prepare_data()
    return workdir


@pytest.mark.slow  # generates with a model
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


@pytest.mark.slow  # generates with a model
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
    assert capsys.readouterr().err.strip() == ("error: models/grpo_dapo: model folder not found "
                                               "(did its stage run?)")


def test_init_of_a_run_without_an_evaluate_inits_entry_is_one_line(inside, capsys):
    from stages.evaluate import main

    with pytest.raises(SystemExit):
        main(["old_run.init"])
    assert capsys.readouterr().err.strip() == (
        "error: params.yaml evaluate.inits: no entry for 'old_run', so the evaluation old_run.init has no "
        "init to evaluate")


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


# ---------------------------------------------------------------- resuming a killed evaluation


def perturb(folder: Path) -> None:
    """Move one weight of the model in `folder` a little (as an RL update would)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, path, metadata={"format": "pt"})


def counting_engines(monkeypatch, kill_at: int | None = None) -> SimpleNamespace:
    """Engines the stage starts (`starts`) and prompts per `generate` call of all of them (`calls`);
    call number `kill_at` raises KeyboardInterrupt instead (a kill between two chunks)."""
    import stages.evaluate as stage
    from parallel_r1.engine import make_engine as real

    calls: list[int] = []
    seen = SimpleNamespace(calls=calls, starts=0)

    def make_engine(*args, **kwargs):
        seen.starts += 1
        engine = real(*args, **kwargs)
        generate = engine.generate

        def counted(prompt_ids, num_generations=1):
            if len(calls) + 1 == kill_at:
                raise KeyboardInterrupt
            calls.append(len(prompt_ids))
            return generate(prompt_ids, num_generations)

        engine.generate = counted
        return engine

    monkeypatch.setattr(stage, "make_engine", make_engine)
    return seen


@pytest.mark.slow  # generates with a model
def test_killed_evaluation_resumes_where_it_stopped(inside, monkeypatch, capsys):
    import stages.evaluate as stage
    from parallel_r1 import generation
    from stages.common import load_params

    monkeypatch.setattr(generation, "CHUNK", 2)
    for out in ("data/samples/base", "metrics/eval/base"):   # as DVC does before it re-runs the stage
        shutil.rmtree(inside / out, ignore_errors=True)
    partial = inside / "data/partial/eval/base.jsonl"
    first = json.loads((inside / "data/eval/aime24.jsonl").open().readline())["id"]
    counting_engines(monkeypatch, kill_at=1)
    with pytest.raises(SystemExit):   # killed before its first chunk finished: no empty partial file
        stage.main(["base"])
    assert not partial.exists()
    counting_engines(monkeypatch, kill_at=2)
    with pytest.raises(SystemExit) as stopped:   # Ctrl-C: one line, exit 130
        stage.main(["base"])
    assert stopped.value.code == 130
    assert not (inside / "data/samples/base").exists()
    kept = [json.loads(line) for line in partial.open()]
    keys = [(r["benchmark"], r["problem_id"], r["sample_index"]) for r in kept]
    assert keys == [("aime24", str(first), 0), ("aime24", str(first), 1)]
    capsys.readouterr()
    calls = counting_engines(monkeypatch).calls
    stage.main(["base"])
    ks = stage.benchmark_ks(load_params())
    total = sum(2 * k for k in ks.values())   # 2 problems per benchmark in the tiny profile
    assert sum(calls) == total - 2 and max(calls) == 2   # only what the kill left, in chunks of 2
    assert f"resuming: 2 samples already in data/partial/eval/base.jsonl, {total - 2} to go" in (
        capsys.readouterr().out)
    assert not partial.exists()
    assert not list((inside / "data/memo/eval").glob("*.json"))  # resumed: other seeds, not memoised
    for benchmark, k in ks.items():   # what an uninterrupted run writes: every problem's k samples
        ids = [str(json.loads(line)["id"]) for line in (inside / "data/eval" / f"{benchmark}.jsonl").open()]
        rows = [json.loads(line) for line in (inside / "data/samples/base" / f"{benchmark}.jsonl").open()]
        assert [(r["problem_id"], r["sample_index"]) for r in rows] == [(i, s) for i in ids for s in range(k)]
        metrics = json.loads((inside / "metrics/eval/base" / f"{benchmark}.json").read_text())
        assert (metrics["n_problems"], metrics["n_samples"]) == (2, 2 * k)
        if benchmark == "aime24":   # the kept chunk is reused, not generated again
            assert [r["response"] for r in rows[:2]] == [r["response"] for r in kept]


@pytest.mark.slow  # generates with a model
def test_killed_scaffold_curve_resumes_without_redoing_a_finished_snapshot(inside, monkeypatch, capsys):
    import stages.evaluate as stage

    run = inside / "models/scaffold"
    shutil.rmtree(run, ignore_errors=True)
    for step in (1, 2):
        shutil.copytree(inside / "models/base", run / "steps" / f"step-{step}")
    perturb(run / "steps/step-2")  # a step that moved the weights: not the memo's step-1 samples
    (run / "rollout.json").write_text(json.dumps({"prompt": "parallel", "variant": "seen", "parallel": True}))
    counting_engines(monkeypatch, kill_at=2)   # step-1 is done in one call, the kill hits step-2
    with pytest.raises(SystemExit) as stopped:   # Ctrl-C: one line, exit 130
        stage.main(["scaffold", "--curve"])
    assert stopped.value.code == 130
    partial = inside / "data/partial/eval"
    assert len((partial / "scaffold-step-1.jsonl").read_text().splitlines()) == 4   # aime25: k=2, 2 problems
    capsys.readouterr()
    engines = counting_engines(monkeypatch)
    stage.main(["scaffold", "--curve"])
    assert (engines.starts, engines.calls) == (1, [4])   # step-2 only: no engine starts for step-1
    # step-1 finished before the kill: its samples come back from the memo
    assert "models/scaffold/steps/step-1: weights and sampling settings already evaluated: its 4 samples" in (
        capsys.readouterr().out)
    curve = json.loads((inside / "metrics/curves/scaffold.json").read_text())
    assert [point["step"] for point in curve["points"]] == [1, 2]
    assert not list(partial.glob("scaffold-*"))


def partial_job(benchmark: str, problem_id: str, index: int):
    from parallel_r1.evaluation import Job

    problem = {"id": problem_id, "question": "q", "ground_truth": "4", "answer_kind": "gsm8k"}
    return Job(benchmark, problem, index, [1, 2, 3])


def partial_row(job, stamp: str = "s1", response: str = "old") -> str:
    row = {"benchmark": job.benchmark, "stamp": stamp, "problem_id": job.key[1],
           "sample_index": job.sample_index, "response": response, "ground_truth": "4",
           "answer_kind": "gsm8k", "completion_tokens": 3, "truncated": False}
    return json.dumps(row) + "\n"


class FakeEngine:
    def __init__(self):
        self.prompts = 0
        self.closed = False

    def generate(self, prompt_ids, num_generations):
        self.prompts += len(prompt_ids)
        return [SimpleNamespace(text="new", completion_ids=[7], truncated=False) for _ in prompt_ids]

    def close(self):
        self.closed = True


def test_resume_reuses_matching_rows_and_drops_an_unfinished_last_line(tmp_path, capsys):
    from parallel_r1.generation import generate_resumably, read_partial
    from stages.common import log, setup_logging

    setup_logging()
    jobs = [partial_job("aime24", "1", i) for i in range(2)] + [partial_job("math", "2", 0)]
    partial = tmp_path / "base.jsonl"
    partial.write_text(partial_row(jobs[0]) + partial_row(jobs[1], stamp="old model")
                       + partial_row(partial_job("aime24", "1", 5)) + partial_row(jobs[2])[:40])
    engine = FakeEngine()
    samples = generate_resumably(jobs, partial, "s1", lambda: engine, "evaluate base", log)
    out = capsys.readouterr().out
    assert "dropping its unfinished last line (40 bytes, killed mid-write)" in out
    assert "resuming: 1 samples already in" in out and "2 to go (2 rows of another setting" in out
    assert engine.prompts == 2 and engine.closed
    assert [samples[job.key].response for job in jobs] == ["old", "new", "new"]
    assert len(read_partial(partial)) == 5   # the cut line is gone, so the appended rows read back whole


def test_nothing_left_to_generate_starts_no_engine(tmp_path):
    from parallel_r1.generation import generate_resumably

    jobs = [partial_job("aime24", "1", 0)]
    partial = tmp_path / "base.jsonl"
    partial.write_text(partial_row(jobs[0]))

    def start_engine():
        raise AssertionError("the engine was started")

    samples = generate_resumably(jobs, partial, "s1", start_engine, "evaluate base")
    assert samples[jobs[0].key].response == "old"


def test_corrupt_partial_line_in_the_middle_is_one_line(tmp_path):
    from parallel_r1.errors import PipelineError
    from parallel_r1.generation import read_partial

    partial = tmp_path / "base.jsonl"
    job = partial_job("aime24", "1", 0)
    partial.write_text(partial_row(job) + partial_row(job)[:30] + "\n" + partial_row(job))
    with pytest.raises(PipelineError, match=r"^\S*base.jsonl:2: not valid JSON \(.*\); truncated file\?$"):
        read_partial(partial)


def test_partial_files_lie_outside_the_stage_outputs():
    from stages.evaluate import partial_path

    assert partial_path("base", Path("models/base")) == Path("data/partial/eval/base.jsonl")
    assert partial_path("scaffold", Path("models/scaffold/steps/step-40")) == Path(
        "data/partial/eval/scaffold-step-40.jsonl")


def test_unseen_models_are_evaluated_with_evaluate_unseen_engine(inside, monkeypatch):
    """evaluate.unseen_engine picks the engine of Unseen models only (exact transformers or fast vLLM);
    "same" and Seen models keep evaluate.engine (the tiny profile's: transformers)."""
    import stages.evaluate as stage

    class Started(Exception):
        pass

    kinds = []

    def make_engine(kind, *args, **kwargs):
        kinds.append(kind)
        raise Started

    monkeypatch.setattr(stage, "make_engine", make_engine)
    params = inside / "params.yaml"
    text = params.read_text()
    models = ("sft_unseen", "sft_seen")
    try:
        for name in models:  # an earlier test may have left a (corrupt) copy there
            shutil.rmtree(inside / "models" / name, ignore_errors=True)
            shutil.copytree(inside / "models/base", inside / "models" / name)
        for setting in ("vllm", "same"):
            set_param(params, "evaluate.unseen_engine", setting)
            for name in models:
                with pytest.raises(Started):
                    stage.main([name])
    finally:
        params.write_text(text)
        for name in models:
            shutil.rmtree(inside / "models" / name, ignore_errors=True)
    assert kinds == ["vllm", "transformers", "transformers", "transformers"]


def test_evaluate_max_batch_size_reaches_the_engine(inside, monkeypatch):
    """evaluate.max_batch_size (rows the transformers engine decodes together) is what the engine gets:
    the tiny profile's 16; a profile may raise it (small: 64)."""
    import stages.evaluate as stage

    class Started(Exception):
        pass

    sizes = []

    def make_engine(kind, *args, **kwargs):
        sizes.append(kwargs["max_batch_size"])
        raise Started

    monkeypatch.setattr(stage, "make_engine", make_engine)
    params = inside / "params.yaml"
    text = params.read_text()
    try:
        for size in (None, 5):
            if size is not None:
                set_param(params, "evaluate.max_batch_size", str(size))
            with pytest.raises(Started):
                stage.main(["base"])
    finally:
        params.write_text(text)
    assert sizes == [16, 5]


def test_partial_samples_of_another_engine_are_not_reused(inside):
    """The resume stamp names the engine: vLLM decodes Unseen summaries causally, so samples it left
    behind must not complete a transformers evaluation (or the other way round)."""
    from parallel_r1.engine import RolloutConfig
    from stages.evaluate import stamp

    config = RolloutConfig(structured=True)
    folder = inside / "models/base"
    assert (stamp(folder, "parallel", config, "float32", "vllm")
            != stamp(folder, "parallel", config, "float32", "transformers"))


# ---------------------------------------------------------------- the sample memo


@pytest.mark.slow  # generates with a model
def test_identical_weights_reuse_their_samples_and_moved_weights_do_not(inside, monkeypatch, capsys):
    """grpo_gsm8k_then_dapo starts from grpo_gsm8k, in the same rollout mode: without a reward spread it
    keeps those weights, so its evaluation reads grpo_gsm8k's samples instead of decoding them again; so
    does grpo_gsm8k's init evaluated as grpo_gsm8k samples. Another prompt, or one changed weight, decodes
    afresh."""
    import stages.evaluate as stage

    baseline = json.dumps({"prompt": "baseline", "variant": "seen", "parallel": False})
    first, second = (inside / "models" / name for name in ("grpo_gsm8k", "grpo_gsm8k_then_dapo"))
    for run in (first, second):
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(inside / "models/base", run)
        (run / "rollout.json").write_text(baseline)
    engines = counting_engines(monkeypatch)
    try:
        stage.main(["grpo_gsm8k"])
        capsys.readouterr()
        stage.main(["grpo_gsm8k_then_dapo"])
        assert engines.starts == 1 and (
            "models/grpo_gsm8k_then_dapo: weights and sampling settings identical "
            "to models/grpo_gsm8k's evaluation") in capsys.readouterr().out
        for benchmark in BENCHMARKS:
            samples, metrics = ([(inside / folder / name / f"{benchmark}{ext}").read_text()
                                 for name in ("grpo_gsm8k", "grpo_gsm8k_then_dapo")]
                                for folder, ext in (("data/samples", ".jsonl"), ("metrics/eval", ".json")))
            assert samples[0] == samples[1]
            assert {**json.loads(metrics[0]), "model": None} == {**json.loads(metrics[1]), "model": None}
        # grpo_gsm8k's init (base) as grpo_gsm8k samples (evaluate_init@grpo_gsm8k): base's weights with the
        # Baseline prompt, which these copies of base just decoded
        params = inside / "params.yaml"
        kept = params.read_text()
        set_param(params, "evaluate.inits", "{grpo_gsm8k: base}")   # as a profile composes it from rl_runs
        try:
            stage.main(["grpo_gsm8k.init"])
        finally:
            params.write_text(kept)
        assert engines.starts == 1 and "identical" in capsys.readouterr().out
        for benchmark in BENCHMARKS:
            paired = json.loads((inside / "metrics/eval/grpo_gsm8k.init" / f"{benchmark}.json").read_text())
            mode = (paired["prompt"], paired["variant"], paired["parallel_rollout"])
            assert mode == ("baseline", "seen", False)
            assert ((inside / "data/samples/grpo_gsm8k.init" / f"{benchmark}.jsonl").read_text()
                    == (inside / "data/samples/grpo_gsm8k" / f"{benchmark}.jsonl").read_text())
        (second / "rollout.json").write_text(json.dumps({"prompt": "parallel", "variant": "seen",
                                                         "parallel": True}))
        stage.main(["grpo_gsm8k_then_dapo"])  # the same weights under another prompt: other samples
        (second / "rollout.json").write_text(baseline)
        perturb(second)
        stage.main(["grpo_gsm8k_then_dapo"])
        assert engines.starts == 3 and "identical" not in capsys.readouterr().out
    finally:
        for run in (first, second):
            shutil.rmtree(run, ignore_errors=True)


def test_memo_answers_come_from_the_current_problems_and_code_changes_miss(tmp_path, monkeypatch):
    """Only generated text is memoised: a corrected answer in data/eval reaches the scores; an edit to
    the generation code, or weights that are not safetensors, give no memo hit."""
    from parallel_r1 import sample_memo, weights_digest
    from parallel_r1.evaluation import sample_from_row

    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model"
    prepare_base_model("tiny", model, tiny=SMALL)
    jobs = [partial_job("gsm8k", "1", 0)]
    sample = json.loads(partial_row(jobs[0], response="Final Answer: 4"))
    key = sample_memo.memo_key(model, {"prompt": "parallel"}, jobs)
    sample_memo.store(key, "models/a", jobs, {jobs[0].key: sample_from_row(sample)})
    corrected = [partial_job("gsm8k", "1", 0)]
    corrected[0].problem["ground_truth"] = "5"
    samples, source = sample_memo.load(key, corrected)
    assert source == "models/a" and samples[jobs[0].key].response == "Final Answer: 4"
    assert samples[jobs[0].key].ground_truth == "5"
    code = tmp_path / "engine.py"
    code.write_text("x = 1\n")
    monkeypatch.setattr(weights_digest, "LIBRARY_CODE", (code,))
    before = sample_memo.memo_key(model, {"prompt": "parallel"}, jobs)
    code.write_text("x = 2\n")
    assert sample_memo.memo_key(model, {"prompt": "parallel"}, jobs) != before
    (model / "pytorch_model.bin").write_bytes(b"pickled")
    assert sample_memo.memo_key(model, {"prompt": "parallel"}, jobs) is None


def test_model_digest_reads_values_not_files(tmp_path):
    """The same values saved in bf16 and in float32 are one model; a changed value is another."""
    import torch

    from parallel_r1.models import load_model
    from parallel_r1.weights_digest import model_digest

    source = tmp_path / "source"
    prepare_base_model("tiny", source, tiny=SMALL)
    model, tokenizer = load_model(source)
    model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    model.to(torch.float32).save_pretrained(tmp_path / "fp32")
    for folder in ("bf16", "fp32"):
        tokenizer.save_pretrained(tmp_path / folder)
    assert ((tmp_path / "bf16/model.safetensors").stat().st_size
            < (tmp_path / "fp32/model.safetensors").stat().st_size)
    assert model_digest(tmp_path / "bf16") == model_digest(tmp_path / "fp32")
    perturb(tmp_path / "fp32")
    assert model_digest(tmp_path / "bf16") != model_digest(tmp_path / "fp32")
