"""reports/run_summary.md: what one pipeline invocation ran, where, how long each stage took, what came out.

Written at the end of `make run` and `flows.reproduce`, as nanochat's run writes its report.md, so a
run's record is a file beside its results instead of a table someone keeps by hand. Everything in it is
read from what the run already wrote: the machine from the OS and torch, stage wall times from the
invocation's MLflow child runs (a stage DVC found up to date has no run and is not listed; one DVC ran while
MLflow was unreachable has none either, and is named as missing), the headline numbers from metrics/ and
reports/table2.md.
"""

from __future__ import annotations

import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

from parallel_r1.io import atomic_path, read_json

SUMMARY_PATH = Path("reports/run_summary.md")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # what decides the dtype a CPU runs in


def cpu_facts(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU's model name and which of CPU_FLAGS it has (from /proc/cpuinfo; empty where there is none)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text(errors="replace") if path.is_file() else ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name") or platform.processor() or "unknown",
            "flags": [flag for flag in CPU_FLAGS if flag in flags]}


def machine(dtype: str) -> dict[str, Any]:
    """Where the run ran and in which dtype its training and decoding ran there (`models.runs_in_bf16`)."""
    import torch

    from parallel_r1.models import runs_in_bf16

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {**cpu_facts(), "cores": os.cpu_count(), "gpus": gpus, "torch": torch.__version__,
            "dtype": "bfloat16" if runs_in_bf16(dtype) else "float32", "python": platform.python_version()}


def _minutes(start_ms: int | None, end_ms: int | None) -> str:
    return "—" if start_ms is None or end_ms is None else f"{(end_ms - start_ms) / 60000:.1f}"


def missing_stage_runs(ran: Sequence[str], stage_runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The stages DVC ran in this invocation that have no MLflow run under it: a stage whose run could not
    be created (the server was down when it started) goes on without one, and nothing logs it later.

    A run stands for the DVC stage its `dvc_stage` tag names, else its name without the bracketed label.
    """
    logged = {run.get("dvc_stage") or str(run["name"]).split(" (", 1)[0] for run in stage_runs}
    return [stage for stage in ran if stage not in logged]


def _quoted(stages: Sequence[str]) -> str:
    return ", ".join(f"`{stage}`" for stage in stages)


def _stage_rows(stage_runs: Sequence[Mapping[str, Any]] | None, ran: Sequence[str] = ()) -> list[str]:
    if stage_runs is None:
        return ["Stage times come from the invocation's MLflow runs; tracking was off or unreachable."
                + (f" DVC ran: {_quoted(ran)}." if ran else "")]
    missing = missing_stage_runs(ran, stage_runs)
    gap = ([f"**Not in MLflow:** {_quoted(missing)} ran in this invocation but have no MLflow run (the "
            "tracking server was unreachable when they started); their logs and metrics/ hold what they did.",
            ""] if missing else [])
    if not stage_runs:
        return gap or ["No stage ran: DVC found every stage up to date."]
    rows = [*gap, "| Stage run | Status | Minutes |", "|---|---|---|"]
    rows += [f"| `{run['name']}` | {run['status']} | {_minutes(run['start_ms'], run['end_ms'])} |"
             for run in stage_runs]
    return rows


def _section(title: str, headers: list[str], rows: list[str]) -> list[str]:
    """A `### title` markdown table of `rows` (already formatted); nothing when there are no rows."""
    if not rows:
        return []
    return [f"### {title}", "", f"| {' | '.join(headers)} |", "|" + "---|" * len(headers), *rows, ""]


def _sft_rows(root: Path) -> list[str]:
    rows = []
    for path in sorted(root.glob("metrics/sft/*/summary.json")):
        summary = read_json(path)
        probe = summary.get("probe") or {}
        rows.append(f"| {summary.get('variant', path.parent.name)} | {summary.get('steps')} | "
                    f"{summary.get('first_loss')} → {summary.get('final_loss')} | "
                    f"{probe.get('parallel_block_rate')} | {probe.get('accuracy')} |")
    return _section("SFT", ["Variant", "Updates", "Loss first → last",
                            "Probe: share with a well-formed block", "Probe accuracy"], rows)


def _rl_rows(root: Path) -> list[str]:
    rows = []
    for path in sorted(root.glob("metrics/rl/*/summary.json")):
        summary = read_json(path)
        steps_path = path.with_name("steps.json")
        history = read_json(steps_path) if steps_path.is_file() else []
        first, last = (history[0], history[-1]) if history else ({}, {})

        def moved(key: str, first: Mapping = first, last: Mapping = last) -> str:
            a, b = first.get(key), last.get(key)
            return "—" if a is None or b is None else f"{a:.2f} → {b:.2f}"

        runtime = root / "metrics" / "runtime" / "rl" / f"{path.parent.name}.json"
        reused_from = read_json(runtime).get("reused_from") if runtime.is_file() else None
        reused = f" (= {reused_from})" if reused_from else ""
        rows.append(f"| `{path.parent.name}`{reused} | {summary.get('reward')} | "
                    f"{summary.get('steps_with_reward_spread')} / {summary.get('steps')} | "
                    f"{moved('reward')} | {moved('parallel_ratio')} | {moved('path_diversity')} |")
    return _section("RL", ["Run", "Reward", "Steps with a reward spread", "Reward first → last",
                           "Parallel ratio", "Path diversity"], rows)


def _first_table(markdown: str) -> list[str]:
    """The first markdown table in `markdown` (its lines), or []."""
    lines, table = markdown.splitlines(), []
    for line in lines:
        if line.startswith("|"):
            table.append(line)
        elif table:
            break
    return table


def _table2_rows(root: Path) -> list[str]:
    path = root / "reports" / "table2.md"
    if not path.is_file():
        return []
    return ["### Table 2 (ours (paper); the whole report: reports/table2.md)", "",
            *_first_table(path.read_text(encoding="utf-8")), ""]


def render(facts: Mapping[str, Any], invocation: str, profile: str, total_seconds: float,
           stage_runs: Sequence[Mapping[str, Any]] | None, root: Path, finished: datetime,
           ran: Sequence[str] = ()) -> str:
    """The summary's markdown; `ran`: the stages DVC ran in this invocation (`missing_stage_runs`)."""
    gpus = ", ".join(facts["gpus"]) or "none"
    lines = [
        f"# Run summary — `{invocation}`, profile `{profile}`", "",
        f"Finished {finished:%Y-%m-%d %H:%M} UTC after {total_seconds / 60:.1f} min.", "",
        "## Machine", "",
        f"- CPU: {facts['model']}, {facts['cores']} cores; flags: {', '.join(facts['flags']) or 'none of '}"
        f"{'' if facts['flags'] else ', '.join(CPU_FLAGS)}",
        f"- GPUs: {gpus}",
        f"- Training and decoding dtype: {facts['dtype']} (torch {facts['torch']}, Python {facts['python']})",
        "", "## Stages that ran", "", *_stage_rows(stage_runs, ran), "", "## Headline numbers", "",
    ]
    headline = _sft_rows(root) + _rl_rows(root) + _table2_rows(root)
    lines += headline or ["No metrics yet (no SFT, RL or Table 2 output in this project)."]
    return "\n".join(lines).rstrip() + "\n"


def write_run_summary(root: Path, invocation: str, params: Mapping[str, Any], total_seconds: float,
                      parent_run_id: str | None, ran: Sequence[str] = ()) -> Path:
    """Write reports/run_summary.md under `root` for the invocation whose MLflow run is `parent_run_id`;
    `ran`: the stages DVC ran (not found up to date nor restored), so those MLflow lacks are named."""
    from parallel_r1 import tracking

    dtype = str((params.get("model") or {}).get("dtype", "float32"))
    text = render(machine(dtype), invocation, str(params.get("profile")), total_seconds,
                  tracking.child_runs(parent_run_id), root, datetime.now(timezone.utc), ran)
    path = root / SUMMARY_PATH
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return path
