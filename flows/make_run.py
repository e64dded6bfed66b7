"""`make run`: `dvc repro` under one MLflow run, so the stage runs of one pipeline run are grouped.

    python -m flows.make_run            # the whole pipeline (what `make run` does)
    python -m flows.make_run table2     # stages and options, as `dvc repro` takes them

The MLflow run is named `make-run@<targets|all>` (tag flow=make-run); DVC gets its id in env
PARALLEL_R1_PARENT_RUN_ID, so every stage run nests under it, as under the `reproduce` and
`sweep` flows, and it ends by writing reports/run_summary.md (parallel_r1/run_summary.py). DVC's output
streams through unchanged; a failure ends with the stage's (or DVC's) one-line error and exit status 1.
A second `make run` (or flow) while this one runs is refused (flows.project_lock).
No Prefect here: `flows.reproduce` does the same
with one Prefect task per stage.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from flows.dvc_runner import run_dvc
from flows.project_lock import project_lock
from parallel_r1 import tracking
from parallel_r1.run_summary import write_run_summary
from stages import profiles
from stages.common import load_params, stage_main

FLOW_TAG = "make-run"


def make_run(args: list[str], root: Path) -> None:
    """`dvc repro <args>` in `root`, its stage runs nested under one MLflow run; refused while another
    pipeline run holds the project lock (flows.project_lock)."""
    with project_lock(root):
        _make_run(args, root)


def _make_run(args: list[str], root: Path) -> None:
    params = load_params(root / "params.yaml")
    edited = profiles.edits(root)
    if edited:  # kept, as DVC would; said, so a result is never silently from a hand-edited profile
        print(f"note: params.yaml differs from conf/profile/{params['profile']}.yaml at "
              f"{', '.join(edited[:3])}{' ...' if len(edited) > 3 else ''}; "
              "running with params.yaml as it is", flush=True)
    targets = [arg for arg in args if not arg.startswith("-")]
    tags = {"flow": FLOW_TAG, tracking.TAG_PROFILE: params["profile"]}
    run_params = {"tracking": params.get("tracking") or {}, "dvc_repro_args": args}
    name = f"{FLOW_TAG}@{','.join(targets) or 'all'}"
    started = time.monotonic()
    with tracking.parent_run(name, params=run_params, tags=tags) as run_id:
        run_dvc(["repro", *args], cwd=root, env=tracking.child_env(run_id))
        summary = write_run_summary(root, name, params, time.monotonic() - started, run_id)
    print(f"run summary: {summary}", flush=True)


@stage_main
def main() -> None:
    try:
        make_run(sys.argv[1:], Path.cwd())
    except KeyboardInterrupt:  # DVC and its stage are stopped; the MLflow run ends KILLED
        print("error: interrupted (Ctrl-C); dvc repro and its stage stopped", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
