"""Shared fixtures: where the data mirror is, and a small tiny model built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MIRROR = Path(os.environ.get("PARALLEL_R1_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def mirror() -> Path:
    if not (MIRROR / "gsm8k" / "train.jsonl").is_file():
        pytest.skip(f"data mirror not found at {MIRROR}")
    return MIRROR
