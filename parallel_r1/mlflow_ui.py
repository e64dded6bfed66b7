"""Addresses in the MLflow UI (3.17): a run's page, and an experiment's runs page with a filter.

The UI is the tracking server itself when MLFLOW_TRACKING_URI is http(s); with the project's
sqlite store it is the server `make ui` starts on 127.0.0.1 (port from env
PARALLEL_R1_MLFLOW_PORT, default 5000). Every link carries `workflowType=machine_learning`:
MLflow 3 otherwise opens an experiment on its GenAI side (traces), not on its runs.
"""

from __future__ import annotations

import os
from urllib.parse import quote, urlencode

HOST = "127.0.0.1"
PORT_ENV, DEFAULT_PORT = "PARALLEL_R1_MLFLOW_PORT", 5000
# Every RL stage run, each tagged with its reward schedule: group the result by tag
# `reward_schedule` to see the schedules side by side (README, "Prefect and MLflow").
RL_RUNS_FILTER = "tags.stage = 'rl'"


def base_url(tracking_uri: str) -> str:
    """The UI's address for runs tracked at `tracking_uri`."""
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    return f"http://{HOST}:{int(os.environ.get(PORT_ENV, DEFAULT_PORT))}"


def runs_url(base: str, experiment_id: str, search_filter: str) -> str:
    """The experiment's runs table, filtered by `search_filter` (MLflow search syntax)."""
    query = urlencode({"workflowType": "machine_learning", "searchFilter": search_filter}, quote_via=quote)
    return f"{base}/#/experiments/{experiment_id}/runs?{query}"


def run_url(base: str, experiment_id: str, run_id: str) -> str:
    """One run's page."""
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"
