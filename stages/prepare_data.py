"""Stage `prepare_data`: the RL prompt sets and evaluation sets in the common record shape.

    dvc repro prepare_data
    python -m stages.prepare_data

Writes data/rl/<name>.jsonl and data/eval/<name>.jsonl from the mirror (or the Hub),
each cut to the profile's `limit`.
"""

from __future__ import annotations

from parallel_r1 import tracking
from parallel_r1.data import load_problems
from parallel_r1.errors import PipelineError
from parallel_r1.io import write_jsonl
from stages.common import load_params, section, stage_main


@stage_main
def main() -> None:
    params = load_params()
    mirror = section(params, "data").get("mirror_dir")
    with tracking.stage_run("prepare_data", params=params):
        for group in ("rl", "eval"):
            for name, spec in section(params, "data", group).items():
                if "source" not in spec:
                    raise PipelineError(f"params.yaml data.{group}.{name}: missing key 'source'")
                problems = load_problems(spec["source"], mirror, spec.get("limit"))
                if not problems:
                    raise PipelineError(f"params.yaml data.{group}.{name}: limit leaves no problems")
                count = write_jsonl(f"data/{group}/{name}.jsonl", problems)
                tracking.log_metrics({f"{group}.{name}.problems": count})
                print(f"data/{group}/{name}.jsonl: {count} problems from {spec['source']}")


if __name__ == "__main__":
    main()
