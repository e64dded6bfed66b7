"""Stage `prepare_data`: the RL prompt sets and evaluation sets in the common record shape.

    dvc repro prepare_data
    python -m stages.prepare_data

Writes data/rl/<name>.jsonl and data/eval/<name>.jsonl from the mirror (or the Hub),
each cut to the profile's `limit`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from parallel_r1 import tracking
from parallel_r1.data import PROBLEM_SETS, load_problems
from parallel_r1.errors import PipelineError
from parallel_r1.io import publish_together
from stages.common import load_params, log, section, stage_main


def check_entry(where: str, spec: object) -> None:
    """A `data.<group>.<name>` entry, checked before any dataset is read (param path in the message)."""
    if not isinstance(spec, dict):
        raise PipelineError(f"{where}: expected a mapping with source and limit, got {spec!r}")
    if "source" not in spec:
        raise PipelineError(f"{where}: missing key 'source'")
    if spec["source"] not in PROBLEM_SETS:
        raise PipelineError(f"{where}.source: unknown dataset {spec['source']!r} "
                            f"(choose from {', '.join(PROBLEM_SETS)})")
    limit = spec.get("limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise PipelineError(f"{where}.limit: must be an integer >= 1 or null, got {limit!r}")


@stage_main
def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.prepare_data",
                                     description=__doc__.splitlines()[0])
    parser.parse_args(argv)  # no arguments (everything comes from params.yaml); --help works
    params = load_params()
    mirror = section(params, "data").get("mirror_dir")
    entries = [(group, name, spec) for group in ("rl", "eval")
               for name, spec in section(params, "data", group).items()]
    for group, name, spec in entries:
        check_entry(f"params.yaml data.{group}.{name}", spec)
    with tracking.stage_run("prepare_data", params=params):
        # Everything is loaded before anything is written: a bad dataset leaves every output as it was.
        loaded = [(group, name, spec["source"], load_problems(spec["source"], mirror, spec.get("limit")))
                  for group, name, spec in entries]
        with publish_together() as outputs:   # every set, or none
            for group, name, _, problems in loaded:
                outputs.write_jsonl(f"data/{group}/{name}.jsonl", problems)
        for group, name, source, problems in loaded:
            tracking.log_metrics({f"{group}.{name}.problems": len(problems)})
            log.info(f"data/{group}/{name}.jsonl: {len(problems)} problems from {source}")


if __name__ == "__main__":
    main(sys.argv[1:])
