"""Both flows as Prefect deployments, served from this process so the UI can run them.

    python -m flows.serve                       # deployments reproduce/parallel-r1, sweep/parallel-r1
    python -m flows.serve --cron "0 3 * * *"    # plus a nightly `dvc repro` of everything

Runs go to the Prefect server in PREFECT_API_URL (`make ui` starts one). The cron schedule
goes on `reproduce` (its defaults reproduce the whole pipeline); a sweep needs its parameters,
so schedule it in the UI: Deployments -> sweep/parallel-r1 -> Schedule, with the parameters.
Each run executes in a subprocess of this one, in the project root (this process's cwd).
"""

from __future__ import annotations

import argparse

from prefect import serve as prefect_serve
from prefect.deployments.runner import RunnerDeployment

from flows.reproduce import reproduce
from flows.sweep import sweep

DEPLOYMENT = "parallel-r1"


def deployments(cron: str | None = None) -> list[RunnerDeployment]:
    """The reproduce and sweep deployments (`<flow>/parallel-r1`); `cron` schedules reproduce."""
    return [
        reproduce.to_deployment(name=DEPLOYMENT, cron=cron, tags=["parallel-r1"],
                                description="dvc repro, one task per DVC stage"),
        sweep.to_deployment(name=DEPLOYMENT, tags=["parallel-r1"],
                            description="configurations x reward schedules x seeds as DVC experiments"),
    ]


def serve(cron: str | None = None) -> None:
    """Register both deployments and execute their runs until interrupted."""
    prefect_serve(*deployments(cron))


def main() -> None:
    parser = argparse.ArgumentParser(description="serve the reproduce and sweep deployments")
    parser.add_argument("--cron", help="cron schedule for reproduce (e.g. '0 3 * * *')")
    serve(cron=parser.parse_args().cron)


if __name__ == "__main__":
    main()
