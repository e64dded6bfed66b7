"""reports/run_summary.md: the machine, the stages that ran and the headline numbers, from the run's own
files."""

from datetime import datetime, timezone

from parallel_r1.io import write_json
from parallel_r1.run_summary import cpu_facts, render

CPUINFO = "processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile\n"
FACTS = {"model": "Some Xeon", "flags": ["avx2", "avx512_bf16"], "cores": 2, "gpus": [], "torch": "2.13.0",
         "dtype": "bfloat16", "python": "3.11.2"}
WHEN = datetime(2026, 12, 4, 12, 30, tzinfo=timezone.utc)


def test_cpu_facts_name_the_model_and_the_flags_that_decide_the_dtype():
    assert cpu_facts(CPUINFO) == {"model": "Some Xeon", "flags": ["avx2", "avx512f", "avx512_bf16"]}
    assert cpu_facts("")["flags"] == []


def test_summary_lists_stage_times_and_the_runs_headline_numbers(tmp_path):
    write_json(tmp_path / "metrics/sft/seen/summary.json",
               {"variant": "seen", "steps": 20, "first_loss": 2.5, "final_loss": 0.8,
                "probe": {"parallel_block_rate": 0.875, "accuracy": 0.0}})
    write_json(tmp_path / "metrics/rl/parallel_only/summary.json",
               {"reward": "parallel_only", "steps": 3, "steps_with_reward_spread": 2})
    write_json(tmp_path / "metrics/rl/parallel_only/steps.json",
               [{"step": 1, "reward": 0.25, "parallel_ratio": 0.5, "path_diversity": 0.1},
                {"step": 3, "reward": 0.75, "parallel_ratio": 0.75, "path_diversity": 0.3}])
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports/table2.md").write_text("# Table 2\n\ntext\n\n| Row | A |\n|---|---|\n"
                                                "| base | 1.0 |\n\nmore\n")
    runs = [{"name": "sft@seen", "status": "FINISHED", "start_ms": 0, "end_ms": 90_000},
            {"name": "rl@parallel_only", "status": "FAILED", "start_ms": 90_000, "end_ms": None}]
    text = render(FACTS, "make-run@all", "small", 600.0, runs, tmp_path, WHEN)
    assert "Finished 2026-12-04 12:30 UTC after 10.0 min." in text
    assert "Some Xeon, 2 cores; flags: avx2, avx512_bf16" in text and "dtype: bfloat16" in text
    assert "| `sft@seen` | FINISHED | 1.5 |" in text and "| `rl@parallel_only` | FAILED | — |" in text
    assert "| seen | 20 | 2.5 → 0.8 | 0.875 | 0.0 |" in text
    assert "| `parallel_only` | parallel_only | 2 / 3 | 0.25 → 0.75 | 0.50 → 0.75 | 0.10 → 0.30 |" in text
    assert "| Row | A |\n|---|---|\n| base | 1.0 |\n" in text and "more" not in text


def test_summary_says_why_stage_times_are_missing_or_empty(tmp_path):
    assert "tracking was off" in render(FACTS, "make-run@all", "tiny", 1.0, None, tmp_path, WHEN)
    nothing = render(FACTS, "make-run@all", "tiny", 1.0, [], tmp_path, WHEN)
    assert "DVC found every stage up to date" in nothing and "No metrics yet" in nothing


def test_summary_names_the_stages_that_ran_while_mlflow_was_unreachable(tmp_path):
    runs = [{"name": "prepare_data", "status": "FINISHED", "start_ms": 0, "end_ms": 60_000,
             "dvc_stage": "prepare_data"},
            {"name": "rl@parallel_only (accuracy)", "status": "FINISHED", "start_ms": 0, "end_ms": 60_000,
             "dvc_stage": "rl@parallel_only"},
            {"name": "evaluate@base", "status": "FINISHED", "start_ms": 0, "end_ms": 60_000}]  # by its name
    ran = ["prepare_data", "sft@seen", "rl@parallel_only", "evaluate@base", "table2"]
    text = render(FACTS, "make-run@all", "small", 600.0, runs, tmp_path, WHEN, ran)
    (line,) = [line for line in text.splitlines() if line.startswith("**Not in MLflow:**")]
    assert line.startswith("**Not in MLflow:** `sft@seen`, `table2` ran in this invocation but have no")
    assert "| `prepare_data` | FINISHED | 1.0 |" in text  # the runs MLflow has are still listed
    only_missing = render(FACTS, "make-run@all", "small", 1.0, [], tmp_path, WHEN, ["sft@seen"])
    assert "**Not in MLflow:** `sft@seen`" in only_missing and "up to date" not in only_missing
    unreachable = render(FACTS, "make-run@all", "small", 1.0, None, tmp_path, WHEN, ["sft@seen", "table2"])
    assert "tracking was off or unreachable. DVC ran: `sft@seen`, `table2`." in unreachable
    complete = render(FACTS, "make-run@all", "small", 1.0, runs, tmp_path, WHEN, ["prepare_data"])
    assert "Not in MLflow" not in complete
