"""Stage `validate`: Great Expectations suites on every dataset the pipeline wrote.

    dvc repro validate
    python -m stages.validate                                  # every data/{teacher,sft,rl,eval}/*.jsonl
    python -m stages.validate data/sft/parallel_gsm8k.jsonl    # only the files named

The folder of a file picks its suite (parallel_r1.validation): teacher outputs, the filtered
SFT set, RL prompt sets or eval sets. Bounds come from params.yaml `validate` (every key
optional). Writes reports/validation/<kind>_<file>.json per dataset and
reports/validation/summary.md. When a suite fails, prints what failed with a few offending
row ids and exits 1, so nothing downstream trains or evaluates on broken data.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import cast

from parallel_r1 import tracking
from parallel_r1.config import from_mapping
from parallel_r1.errors import PipelineError
from parallel_r1.io import read_jsonl
from parallel_r1.validation import KINDS, Kind, ValidationConfig, validate_dataset, write_reports
from stages.common import load_params, log, stage_main

DATA_DIR = Path("data")
REPORT_DIR = Path("reports/validation")


def kind_of(path: Path) -> Kind:
    """The dataset kind of `path`: the name of its nearest parent folder that is a kind."""
    for parent in path.parents:
        if parent.name in KINDS:
            return cast(Kind, parent.name)
    raise PipelineError(f"{path}: cannot tell its dataset kind; put it under a folder named one of "
                        f"{', '.join(KINDS)} (as data/<kind>/<name>.jsonl)")


def dataset_paths(explicit: list[str]) -> list[Path]:
    """The files named on the command line, else every JSONL the pipeline wrote under data/."""
    if explicit:
        return [Path(p) for p in explicit]
    # dot files are never datasets: an interrupted write's temporary, an older version's partial output
    paths = [path for kind in KINDS for path in sorted((DATA_DIR / kind).glob("*.jsonl"))
             if not path.name.startswith(".")]
    if not paths:
        raise PipelineError(f"no datasets to validate: {DATA_DIR}/{{{','.join(KINDS)}}}/*.jsonl is empty "
                            "(run the data stages first)")
    return paths


@stage_main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.validate", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*",
                        help="JSONL files to validate (default: every dataset under data/)")
    args = parser.parse_args(argv)
    params = load_params()
    config = from_mapping(ValidationConfig, params.get("validate"), "params.yaml validate")

    names: dict[str, Path]
    reports, names = [], {}
    for path in dataset_paths(args.paths):
        kind = kind_of(path)
        name = f"{kind}_{path.stem}"
        if name in names:
            raise PipelineError(f"{path}: same report name {name!r} as {names[name]}")
        names[name] = path
        rows = read_jsonl(path, allow_empty=True)  # an empty file is reported as a failed suite
        reports.append(validate_dataset(rows, kind, name, config))
    write_reports(reports, REPORT_DIR)
    failed = [report for report in reports if not report.success]
    with tracking.stage_run("validate", params=params):   # FAILED in MLflow when a suite fails
        tracking.log_metrics({"datasets": len(reports), "failed": len(failed)})
        tracking.log_artifact(REPORT_DIR / "summary.md")
        for report in reports:
            log.info(report.summary() if report.warnings and report.success else report.status_line())
        if failed:
            print("\n" + "\n".join(report.summary() for report in failed), file=sys.stderr)
            raise PipelineError(f"validation failed for {len(failed)} of {len(reports)} dataset(s) "
                                f"({', '.join(r.name for r in failed)}); see {REPORT_DIR / 'summary.md'}")
    log.info(f"all {len(reports)} dataset(s) valid; reports in {REPORT_DIR}")


if __name__ == "__main__":
    main()
