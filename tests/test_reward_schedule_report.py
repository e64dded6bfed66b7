"""reports/reward_schedules.md is built from the RL runs' metric files (its DVC deps), not from MLflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parallel_r1.errors import PipelineError

RUNS = {"parallel_r1_unseen_s1": "accuracy", "parallel_r1_unseen_parallel_only": "parallel_only",
        "parallel_r1_unseen_parallel_diversity": "parallel_diversity",
        "parallel_r1_unseen_s2": "alternating", "scaffold": "scaffold"}


def write_run(root: Path, run: str, reward: str, rewards: list[float]) -> None:
    folder = root / "metrics" / "rl" / run
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"run": run, "reward": reward}))
    steps = [{"step": step, "reward": value, "accuracy": 0.5, "parallel_ratio": None}
             for step, value in enumerate(rewards, start=1)]
    (folder / "steps.json").write_text(json.dumps(steps))


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # An unreachable tracking store: the report must not need one.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'absent' / 'mlflow.db'}")
    for index, (run, reward) in enumerate(RUNS.items()):
        write_run(tmp_path, run, reward, [0.1 * index, 0.2 * index, 0.3 * index])
    return tmp_path


def test_report_compares_every_schedule_from_the_step_files(project):
    from stages.reports import build

    out = build("reward_schedules", {"profile": "tiny"})
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "rl@" in line]
    assert [row.split(" | ")[1] for row in rows] == [f"rl@{run}" for run in RUNS]
    scaffold = rows[-1].split(" | ")
    assert scaffold[:3] == ["| scaffold (S2, then accuracy-only)", "rl@scaffold", "3"]
    assert scaffold[3] == "0.400 → 1.200"  # first → last reward
    assert scaffold[5] == "—"  # parallel_ratio None in every step -> no points, not 0
    assert ("path_diversity first → last" in text
            and "parallel + diversity (beyond the paper's tables)" in text)
    assert "No finished runs" not in text and "metrics/rl/<run>/steps.json" in text
    assert (project / "reports" / "reward_schedules.png").read_bytes()[:4] == b"\x89PNG"


def test_run_on_a_schedule_the_report_does_not_compare_is_one_line(project):
    from stages.reports import build

    (project / "metrics/rl/scaffold/summary.json").write_text(json.dumps({"reward": "tiered"}))
    with pytest.raises(PipelineError, match=r"^metrics/rl/scaffold/summary.json: reward 'tiered' is not"):
        build("reward_schedules", {"profile": "tiny"})


def test_plot_step_axis_has_whole_steps_only(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from parallel_r1 import reward_schedule_report as report

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure the plot would close
    run = report.RunCurves("id", "parallel_only", "parallel_only",
                           {"reward": [(1, 0.1), (2, 0.4)], "accuracy": [(1, 0.0), (2, 0.0)]})
    report.plot([run], tmp_path / "plot.png")
    (figure,) = figures
    figure.canvas.draw()
    for axis in figure.axes:
        ticks = [tick for tick in axis.get_xticks() if 1 <= tick <= 2]
        assert ticks and all(float(tick).is_integer() for tick in ticks), ticks
    plt.close(figure)
