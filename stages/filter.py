"""Stage `filter`: Algorithm 1 on every teacher dataset; Parallel-GSM8K for SFT.

    dvc repro filter
    python -m stages.filter

Reads data/teacher/<dataset>.jsonl for every dataset of `generate_datasets`, writes
metrics/filter/<dataset>.json (examples, valid %, rejection reasons) and the SFT set
data/sft/parallel_<filter.sft_dataset>.jsonl. An SFT set with zero rows stops here,
before anything trains on nothing.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from parallel_r1 import tracking
from parallel_r1.config import from_mapping
from parallel_r1.errors import PipelineError
from parallel_r1.filtering import FilterConfig, filter_outputs
from parallel_r1.io import publish_together, read_jsonl
from stages.common import load_params, log, section, stage_main

TRACKED = ("examples", "valid", "valid_pct", "kept")   # per-dataset metrics logged to MLflow
TEACHER_FIELDS = ("id", "question", "ground_truth", "completion_tokens", "source", "model")


@stage_main
def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.filter", description=__doc__.splitlines()[0])
    parser.parse_args(argv)  # no arguments (everything comes from params.yaml); --help works
    params = load_params()
    config = from_mapping(FilterConfig, section(params, "filter"), "params.yaml filter")
    datasets = section(params, "generate_datasets")
    if config.sft_dataset not in datasets:
        raise PipelineError(f"params.yaml filter.sft_dataset: {config.sft_dataset!r} is not in "
                            "generate_datasets")
    with tracking.stage_run("filter", params=params):
        # Every dataset is read and filtered before anything is written, so a bad file or an empty
        # SFT set leaves all previous outputs as they were instead of half of them replaced.
        results = {}
        for name in datasets:
            path = f"data/teacher/{name}.jsonl"
            rows = read_jsonl(path, required=TEACHER_FIELDS)
            for lineno, row in enumerate(rows, start=1):
                if "completion" not in row:
                    raise PipelineError(f"{path}:{lineno}: missing field completion")
                if not isinstance(row["completion"], str):
                    raise PipelineError(f"{path}:{lineno}: field completion must be a string, "
                                        f"got {type(row['completion']).__name__}")
            result = filter_outputs(rows, config)
            if name == config.sft_dataset and not result.kept:
                raise PipelineError(f"{path}: the filter kept 0 of {len(rows)} rows — no SFT data "
                                    f"(dropped: {result.drop_reasons()})")
            results[name] = (result, result.metrics(name, rows[0]["source"], rows[0]["model"]))
        with publish_together() as outputs:   # every output, or none (a write error leaves them all)
            for name, (result, metrics) in results.items():
                outputs.write_json(f"metrics/filter/{name}.json", metrics)
                if name == config.sft_dataset:
                    outputs.write_jsonl(f"data/sft/parallel_{name}.jsonl", result.kept)
        for name, (_, metrics) in results.items():
            tracking.log_metrics({f"{name}.{key}": metrics[key] for key in TRACKED})
            log.info(f"{name}: {metrics['valid']}/{metrics['examples']} valid ({metrics['valid_pct']}%), "
                     f"{metrics['kept']} kept, reasons {metrics['reasons']}")


if __name__ == "__main__":
    main(sys.argv[1:])
