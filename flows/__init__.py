"""Prefect flows around the DVC pipeline; MLflow watches every run.

- `flows.reproduce`: `dvc repro` one stage per Prefect task, in DVC's order (`make run`).
- `flows.sweep`: configurations x reward schedules x seeds as DVC experiments, with a
  comparison table artifact.
- `flows.serve`: both flows as deployments, so the Prefect UI can run and schedule them.
- `flows.ui`: Prefect + MLflow servers on 127.0.0.1 with the deployments served (`make ui`).
- `flows.workpool`: the Prefect work pool sweeps and `reproduce --pool` fan out to; `make worker`.
- `flows.experiment`, `flows.pool_stage`: what a worker runs (one experiment; one stage), in a private
  clone, through the git and DVC remotes (`flows.remote`). docs/scale_out.md tells the whole story.

The flows run DVC in subprocesses from the project root (the working directory) and pass
their MLflow run id down in env PARALLEL_R1_PARENT_RUN_ID, so stage runs nest under them.
"""

import os

# Prefect's ephemeral API (used when no PREFECT_API_URL is set) gets 20 s to start by default;
# on a busy 2-core machine it needs more. Set here, before any flow module imports prefect.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
