"""Tables and figures built from small metric fixtures, the paper's numbers beside ours."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest
import yaml
from PIL import Image

from parallel_r1 import reports
from parallel_r1.errors import PipelineError
from stages import reports as stage

TABLE2_MODELS = reports.ReportOptions().table2_rows
EXTRA_MODELS = ("parallel_r1_seen_without_gsm8k_rl", "parallel_r1_unseen_s1_with_gsm8k_rl",
                "parallel_r1_seen_without_prompt", "parallel_r1_unseen_parallel_only",
                "parallel_r1_unseen_parallel_diversity")
# k and problems per benchmark in the fixture: 16 samples x 2 problems, MATH 1 x 4.
SHAPE = {"aime25": (16, 2), "aime24": (16, 2), "amc23": (16, 2), "math": (1, 4)}


def bench_metrics(model: str, bench: str, mean: float = 0.1, ratio: float = 0.0,
                  profile: str = "tiny") -> dict:
    k, problems = SHAPE[bench]
    return {"model": model, "benchmark": bench, "profile": profile, "k": k, "n_problems": problems,
            "n_samples": k * problems, "mean_at_k": mean, "pass_at_k": min(1.0, 2 * mean),
            "parallel_ratio": ratio, "parallel_position": 0.5 if ratio else None,
            "mean_response_tokens": 100.0, "truncated": 1}


def fixture_metrics() -> dict[str, dict[str, dict]]:
    """Default numbers for every model; two rows hold hand-checked values."""
    models = list(TABLE2_MODELS.values()) + list(EXTRA_MODELS)
    metrics = {m: {b: bench_metrics(m, b) for b in reports.BENCHMARKS} for m in models}
    # base: parallel samples 16 + 0 + 8 + 4 of 100 -> parallel ratio 28.0;
    # position weighted by parallel samples: (16 * 0.5 + 8 * 0.2 + 4 * 0.8) / 28 = 0.457
    for bench, ratio, position in [("aime25", 0.5, 0.5), ("aime24", 0.0, None), ("amc23", 0.25, 0.2),
                                   ("math", 1.0, 0.8)]:
        metrics["base"][bench].update(parallel_ratio=ratio, parallel_position=position)
    # parallel_r1_seen: AIME25 25.0 (paper 19.2, Δ +5.8); Avg. (25+15+40+60)/4 = 35.0 (paper 48.9, Δ -13.9)
    for bench, mean in {"aime25": 0.25, "aime24": 0.15, "amc23": 0.40, "math": 0.60}.items():
        metrics["parallel_r1_seen"][bench]["mean_at_k"] = mean
    return metrics


def write_fixture(root: Path, metrics: dict) -> None:
    for model, benches in metrics.items():
        for bench, values in benches.items():
            path = root / "metrics" / "eval" / model / f"{bench}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
    (root / "params.yaml").write_text(yaml.safe_dump({"profile": "tiny"}))


def table_row(markdown: str, section: str, label: str) -> list[str]:
    """Cells of the row starting with `label` in the first table after the line `section`."""
    lines = markdown.splitlines()
    start = lines.index(section) if section else 0
    row = next(line for line in lines[start:] if line.startswith(f"| {label} |"))
    return [cell.strip() for cell in row.strip("|").split("|")]


@pytest.fixture
def project(tmp_path, monkeypatch):
    write_fixture(tmp_path, fixture_metrics())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PARALLEL_R1_TRACKING", "off")
    return tmp_path


# ---------------------------------------------------------------- Table 2


def test_table2_lists_every_paper_row_with_the_papers_numbers():
    markdown = reports.table2(fixture_metrics(), TABLE2_MODELS, "tiny")
    for key, values in reports.paper_results()["table2_main"]["rows"].items():
        cells = table_row(markdown, "", reports.ROW_LABELS[key])
        assert (cells[1].endswith(f"`models/{TABLE2_MODELS[key]}`")
                or cells[1].endswith(f"`models/{TABLE2_MODELS[key]}`)"))
        assert [c.split("(")[1].rstrip(")") for c in cells[2:]] == [f"{v:.1f}" for v in values]


def test_table2_delta_is_ours_minus_paper():
    markdown = reports.table2(fixture_metrics(), TABLE2_MODELS, "tiny")
    ours = table_row(markdown, "", "Parallel-R1-Seen")
    delta = table_row(markdown, "## Δ = ours − paper (percentage points)", "Parallel-R1-Seen")
    assert ours[3] == "25.0 (19.2)" and delta[3] == "+5.8"  # AIME25 mean@16
    assert ours[-1] == "35.0 (48.9)" and delta[-1] == "-13.9"  # Avg.


def test_table2_parallel_ratio_and_position_pool_samples_of_all_benchmarks():
    markdown = reports.table2(fixture_metrics(), TABLE2_MODELS, "tiny")
    assert table_row(markdown, "", "Qwen3-4B-Base")[2] == "28.0 (0.0)"
    details = table_row(markdown, "## Sample details (ours)", "Qwen3-4B-Base")
    assert details[2:] == ["100", "4", "100.0", "0.46", "—"]  # no path diversity in the fixture


def test_table2_states_profile_and_sample_counts():
    markdown = reports.table2(fixture_metrics(), TABLE2_MODELS, "tiny")
    assert "**profile: tiny** — a random-init tiny model; accuracies are not comparable" in markdown
    assert "AIME25: k=16 × 2 problems" in markdown and "MATH: k=1 × 4 problems" in markdown
    assert "AIME25 mean@16" in markdown and "MATH mean@1" in markdown


def test_paper_avg_column_follows_its_avg_definition():
    table = reports.paper_results()["table2_main"]
    for key, values in table["rows"].items():
        row = dict(zip(table["columns"], values, strict=False))
        assert sum(row[c] for c in reports.AVG_COLUMNS) / 4 == pytest.approx(row["avg"], abs=0.051), key


def test_table2_missing_metric_names_the_file():
    metrics = fixture_metrics()
    del metrics["grpo_dapo"]["amc23"]
    with pytest.raises(PipelineError, match=r"^metrics/eval/grpo_dapo/amc23\.json: missing"):
        reports.table2(metrics, TABLE2_MODELS, "tiny")


def test_table2_refuses_metrics_of_another_profile():
    metrics = fixture_metrics()
    metrics["base"]["math"]["profile"] = "paper"
    with pytest.raises(PipelineError, match="computed for profile 'paper', the report is for 'tiny'"):
        reports.table2(metrics, TABLE2_MODELS, "tiny")


def test_table2_rows_must_cover_the_papers_rows():
    rows = dict(TABLE2_MODELS)
    del rows["grpo_dapo"]
    with pytest.raises(PipelineError, match="no model given for paper row 'grpo_dapo'"):
        reports.table2(fixture_metrics(), rows, "tiny")


def test_delta_uses_the_rounded_number_shown():
    assert reports.delta(12.34, 19.2) == "-6.9"
    assert reports.delta(19.2, 19.2) == "0.0"
    assert reports.delta(None, 19.2) == "—"


# ---------------------------------------------------------------- ablations


def test_ablation_training_shows_each_row_and_paper_avg():
    markdown = reports.ablation_training(fixture_metrics(), profile="tiny")
    cells = table_row(markdown, "", reports.ROW_LABELS["parallel_r1_seen_without_gsm8k_rl"])
    assert cells[1:] == ["`models/parallel_r1_seen_without_gsm8k_rl`", "10.0", "46.6", "-36.6"]
    assert table_row(markdown, "", "Parallel-R1-Seen")[2:] == ["35.0", "48.9", "-13.9"]


def test_ablation_prompt_compares_avg_and_aime25():
    markdown = reports.ablation_prompt(fixture_metrics(), profile="tiny")
    cells = table_row(markdown, "", reports.ROW_LABELS["without_prompt"])
    assert cells[1:] == ["`models/parallel_r1_seen_without_prompt`", "10.0", "47.1", "-37.1", "10.0", "20.4",
                         "-10.4"]


def test_ablation_reward_leaves_cells_the_paper_lacks_empty():
    markdown = reports.ablation_reward(fixture_metrics(), profile="tiny")
    cells = table_row(markdown, "", reports.ROW_LABELS["alternating"])
    assert cells[1:] == ["`models/parallel_r1_unseen_s2`", "0.0", "63.0", "-63.0", "10.0", "—", "—"]
    assert "80.3" in markdown and "59.4" in markdown
    beyond = table_row(markdown, "", reports.ROW_LABELS["parallel_diversity"])   # no paper number: "—"
    assert beyond[1] == "`models/parallel_r1_unseen_parallel_diversity`" and beyond[3::3] == ["—", "—"]
    assert "beyond the paper's tables" in markdown


# ---------------------------------------------------------------- Table 1


def test_table1_states_source_and_paper_valid_rate():
    filter_metrics = {
        "gsm8k": {"dataset": "gsm8k", "source": "released", "model": "deepseek-ai/DeepSeek-R1-0528-Qwen3-8B",
                  "examples": 10, "valid": 8, "valid_pct": 80.0,
                  "reasons": {"too_few_paths": 1, "unclosed_tag": 1}, "kept": 7,
                  "dropped_no_numeric_answer": 1, "dropped_token_cap": 0},
        "dapo": {"dataset": "dapo", "source": "model", "model": "base", "examples": 5, "valid": 0,
                 "valid_pct": 0.0, "reasons": {"no_parallel_block": 5}, "kept": 0,
                 "dropped_no_numeric_answer": 0, "dropped_token_cap": 0},
    }
    markdown = reports.table1(filter_metrics, "tiny")
    gsm8k = table_row(markdown, "", "gsm8k")
    assert gsm8k[:7] == ["gsm8k", "released generations of deepseek-ai/DeepSeek-R1-0528-Qwen3-8B",
                         "10 (7472)", "8", "80.0", "83.7", "-3.7"]
    dapo = table_row(markdown, "", "dapo")
    assert dapo[1] == "model: base" and dapo[4:] == ["0.0", "0.0", "0.0", "no_parallel_block: 5"]
    assert "profile: tiny" in markdown


# ---------------------------------------------------------------- figures


def assert_png(path: Path) -> None:
    assert path.stat().st_size > 0
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 0 and image.size[1] > 0
    assert matplotlib.image.imread(path).shape[0] > 0


def test_figure3_draws_runs_with_gaps_for_steps_without_blocks(tmp_path):
    steps = [{"step": s, "parallel_position": p} for s, p in [(1, 0.2), (2, None), (3, 0.4), (4, 0.5)]]
    out = tmp_path / "fig3.png"
    reports.figure3_parallel_position({"seen": steps, "unseen": [{"step": 1, "parallel_position": None}]},
                                      out, profile="tiny")
    assert_png(out)


def test_figure3_names_the_run_of_a_bad_steps_file(tmp_path):
    with pytest.raises(PipelineError, match="metrics/rl/seen/steps.json: entry 0 lacks"):
        reports.figure3_parallel_position({"seen": [{"step": 1}]}, tmp_path / "f.png", profile="tiny")


def test_figure4_draws_curve_with_switch_and_paper_peak(tmp_path):
    curve = {"benchmark": "aime25", "switch_step": 2, "k": 2,
             "points": [{"step": s, "mean_at_k": 0.1 * s, "pass_at_k": 0.2, "parallel_ratio": 1 / s}
                        for s in range(1, 5)]}
    out = tmp_path / "fig4.png"
    reports.figure4_scaffold(curve, out, profile="paper")
    assert_png(out)


# ---------------------------------------------------------------- the stage


def test_stage_writes_table2_from_the_metric_files(project):
    stage.main(["table2"])
    markdown = (project / "reports" / "table2.md").read_text()
    assert table_row(markdown, "", "Parallel-R1-Seen")[3] == "25.0 (19.2)"


def test_stage_build_is_an_mlflow_run_with_the_report_as_artifact(project, monkeypatch):
    from mlflow import MlflowClient

    uri = f"sqlite:///{project / 'mlflow.db'}"
    monkeypatch.setenv("PARALLEL_R1_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "reports-test")
    stage.main(["table2"])
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("reports-test").experiment_id])
    assert (run.info.run_name, run.info.status, run.data.tags["profile"]) == ("table2", "FINISHED", "tiny")
    (artifact,) = client.list_artifacts(run.info.run_id)
    assert artifact.path == "table2.md"


def test_stage_missing_metric_file_fails_with_one_line(project, capsys):
    (project / "metrics" / "eval" / "sft_unseen" / "math.json").unlink()
    with pytest.raises(SystemExit) as exit_info:
        stage.main(["table2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1
    assert err.count("\n") == 1 and "metrics/eval/sft_unseen/math.json: file not found" in err


def test_a_row_the_profile_does_not_evaluate_reads_not_evaluated(project):
    """A model left out of evaluate.models has no metric files: its rows say so instead of failing, and the
    sample counts are over the evaluated rows only."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["evaluate"] = {"models": [m for m in TABLE2_MODELS.values() if m != "parallel_r1_seen"]}
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    for path in (project / "metrics" / "eval" / "parallel_r1_seen").iterdir():
        path.unlink()
    stage.main(["table2"])
    markdown = (project / "reports" / "table2.md").read_text()
    assert table_row(markdown, "", "Parallel-R1-Seen")[3] == "— (19.2)"
    assert table_row(markdown, "## Sample details (ours)", "Parallel-R1-Seen")[2] == "not evaluated"
    assert "Not evaluated on this profile: `models/parallel_r1_seen`" in markdown
    assert table_row(markdown, "", "Parallel-R1-Unseen (S1)")[3] != "— (19.2)"
    stage.main(["ablation_prompt"])   # both rows' models left out: a table of dashes, not an error
    markdown = (project / "reports" / "ablation_prompt.md").read_text()
    assert "Samples per model: none" in markdown


def test_stage_reads_row_mapping_from_params(project):
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["reports"] = {"ablation_prompt_rows": {"with_prompt": "base", "without_prompt": "sft_seen"}}
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    stage.main(["ablation_prompt"])
    markdown = (project / "reports" / "ablation_prompt.md").read_text()
    assert table_row(markdown, "", reports.ROW_LABELS["with_prompt"])[1] == "`models/base`"


def test_stage_draws_both_figures(project):
    for run in ("parallel_r1_seen", "parallel_r1_unseen_s1", "parallel_r1_unseen_s2"):
        path = project / "metrics" / "rl" / run / "steps.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps([{"step": 1, "parallel_position": 0.3},
                                    {"step": 2, "parallel_position": None}]))
    curve = {"benchmark": "aime25", "switch_step": 1, "k": 2,
             "points": [{"step": 1, "mean_at_k": 0.0, "pass_at_k": 0.0, "parallel_ratio": 0.5}]}
    (project / "metrics" / "curves").mkdir()
    (project / "metrics" / "curves" / "scaffold.json").write_text(json.dumps(curve))
    stage.main(["figure3"])
    stage.main(["figure4"])
    assert_png(project / "reports" / "figure3_parallel_position.png")
    assert_png(project / "reports" / "figure4_scaffold.png")


def test_gsm8k_column_and_ratio_over_every_evaluated_benchmark():
    metrics = fixture_metrics()
    for model in TABLE2_MODELS.values():  # GSM8K test: 8 questions x 1 sample, half of them with a block
        metrics[model]["gsm8k"] = {**bench_metrics(model, "math", mean=0.25, ratio=0.5), "benchmark": "gsm8k",
                                   "n_problems": 8, "n_samples": 8, "path_diversity": 0.4}
    text = reports.table2(metrics, TABLE2_MODELS, "tiny")
    header = next(line for line in text.splitlines() if line.startswith("| Row (paper) | Ours |"))
    assert header.rstrip(" |").endswith("GSM8K mean@1 (ours only)")
    cells = table_row(text, "", "Qwen3-4B-Base")
    assert cells[-1] == "25.0"  # the GSM8K column, no paper number beside it
    # base: (16 + 0 + 8 + 4 + 4 parallel GSM8K samples) of 108 samples
    assert cells[2].startswith(f"{100 * 32 / 108:.1f} (")
    details = table_row(text, "## Sample details (ours)", "Qwen3-4B-Base")
    assert details[-1] == "0.40"  # path diversity: only GSM8K reported one


def test_table2_names_the_profiles_base_model_beside_the_papers_row():
    text = reports.table2(fixture_metrics(), TABLE2_MODELS, "tiny", base_model_label="SmolLM2-135M-Instruct")
    cells = table_row(text, "", "Qwen3-4B-Base")
    assert cells[1] == f"SmolLM2-135M-Instruct (`models/{TABLE2_MODELS['qwen3_4b_base']}`)"


def test_table2_states_the_temperature_its_samples_were_drawn_at():
    """It said "temperature 1.0" whatever the profile sampled at (the small profile evaluates at 0.6)."""
    text = reports.table2(fixture_metrics(), TABLE2_MODELS, "tiny", temperature=0.6)
    assert "sampled at temperature 0.6;" in text and "temperature 1.0;" not in text


def test_table2_without_gsm8k_has_no_gsm8k_column():
    text = reports.table2(fixture_metrics(), TABLE2_MODELS, "tiny")
    assert all("GSM8K" not in line for line in text.splitlines() if line.startswith("| Row |"))


def test_rl_runs_report_counts_steps_with_a_gradient():
    summaries = {"parallel_r1_unseen_parallel_only": {"reward": "parallel_only", "variant": "unseen",
                                                      "steps": 3, "steps_with_reward_spread": 2}}
    steps = {"parallel_r1_unseen_parallel_only": [
        {"step": 1, "reward": -0.5, "parallel_ratio": 0.25, "accuracy": 0.0, "path_diversity": 0.6},
        {"step": 2, "reward": 0.0, "parallel_ratio": 0.5, "accuracy": 0.0, "path_diversity": None},
        {"step": 3, "reward": 0.5, "parallel_ratio": 0.75, "accuracy": 0.0, "path_diversity": 0.4}]}
    text = reports.rl_runs(summaries, steps, "small")
    assert "SmolLM2-135M-Instruct" in text.splitlines()[2]  # the banner names the default model
    cells = table_row(text, "", "`parallel_r1_unseen_parallel_only`")
    assert cells[2:9] == ["no", "unseen", "2 / 3", "-0.50 → 0.50", "0.25 → 0.75", "0.00 → 0.00", "0.50"]


def test_rl_runs_report_shows_no_speed_or_resume_facts():
    """Timings and resume points differ between equal runs: the report that depends on the summaries
    neither shows nor needs them (they are in metrics/runtime/rl/)."""
    summary = {"reward": "accuracy", "variant": "seen", "steps": 2, "steps_with_reward_spread": 0}
    text = reports.rl_runs({"grpo_dapo": summary}, {}, "small")
    assert table_row(text, "", "`grpo_dapo`")[2:5] == ["yes", "seen", "0 / 2"]
    assert "s / step" not in text and "metrics/runtime/rl/" in text


def test_rl_runs_report_names_a_summary_missing_its_keys():
    with pytest.raises(PipelineError,
                       match=r"metrics/rl/x/summary.json: missing key\(s\) steps_with_reward_spread"):
        reports.rl_runs({"x": {"reward": "accuracy", "variant": "seen", "steps": 2}}, {}, "small")
