"""Stage `prepare_data`: the RL prompt sets and evaluation sets in the common record shape.

    dvc repro prepare_data
    python -m stages.prepare_data

Writes data/rl/<name>.jsonl and data/eval/<name>.jsonl from the data mirror (`make data`), or generated
(`source: arithmetic` with a `level` of `data.arithmetic.levels` and a `split`, train or heldout:
parallel_r1/arithmetic.py), each cut to the profile's `limit`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from parallel_r1 import arithmetic, tracking
from parallel_r1.config import from_mapping
from parallel_r1.data import GENERATED, PROBLEM_SETS, load_problems
from parallel_r1.errors import PipelineError
from parallel_r1.io import publish_together
from stages.common import load_params, log, section, stage_main

ENTRY_KEYS = ("source", "limit")
GENERATED_KEYS = (*ENTRY_KEYS, "level", "split")
ARITHMETIC_KEYS = ("seed", "heldout", "levels")


def check_entry(where: str, spec: object, levels: dict) -> None:
    """A `data.<group>.<name>` entry, checked before any dataset is read (param path in the message)."""
    if not isinstance(spec, dict):
        raise PipelineError(f"{where}: expected a mapping with source and limit, got {spec!r}")
    if "source" not in spec:
        raise PipelineError(f"{where}: missing key 'source'")
    sources = (*PROBLEM_SETS, GENERATED)
    if spec["source"] not in sources:
        raise PipelineError(f"{where}.source: unknown dataset {spec['source']!r} "
                            f"(choose from {', '.join(sources)})")
    allowed = GENERATED_KEYS if spec["source"] == GENERATED else ENTRY_KEYS
    unknown = sorted(set(spec) - set(allowed))
    if unknown:
        raise PipelineError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(allowed)})")
    if spec["source"] == GENERATED:
        if spec.get("level") not in levels:
            raise PipelineError(f"{where}.level: {spec.get('level')!r} is not a level of "
                                f"data.arithmetic.levels (known: {', '.join(levels) or 'none'})")
        if spec.get("split") not in arithmetic.SPLITS:
            raise PipelineError(f"{where}.split: {spec.get('split')!r} is unknown "
                                f"(choose from {', '.join(arithmetic.SPLITS)})")
    limit = spec.get("limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise PipelineError(f"{where}.limit: must be an integer >= 1 or null, got {limit!r}")


def arithmetic_levels(params: dict) -> tuple[dict, dict[str, arithmetic.ArithmeticLevel]]:
    """`data.arithmetic` (seed, heldout, levels), each level checked; ({}, {}) when the profile has none."""
    where = "params.yaml data.arithmetic"
    settings = section(params, "data").get("arithmetic") or {}
    unknown = sorted(set(settings) - set(ARITHMETIC_KEYS))
    if unknown:
        raise PipelineError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(ARITHMETIC_KEYS)})")
    for key in ("seed", "heldout"):
        value = settings.get(key, 0 if key == "seed" else 64)
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "seed" else 1):
            raise PipelineError(f"{where}.{key}: must be an integer >= {0 if key == 'seed' else 1}, "
                                f"got {value!r}")
    levels = {name: from_mapping(arithmetic.ArithmeticLevel,
                                 {key: tuple(value) if key in ("operations", "templates") else value
                                  for key, value in (spec or {}).items()}, f"{where}.levels.{name}")
              for name, spec in (settings.get("levels") or {}).items()}
    return settings, levels


def problems_of(spec: dict, mirror: str | None, arithmetic_settings: dict,
                levels: dict[str, arithmetic.ArithmeticLevel]) -> list[dict]:
    """One entry's problems: generated (its level and split), else read from the mirror."""
    if spec["source"] != GENERATED:
        return load_problems(spec["source"], mirror, spec.get("limit"))
    level = spec["level"]
    try:
        problems = arithmetic.split_problems(level, levels[level], arithmetic_settings.get("seed", 0),
                                             arithmetic_settings.get("heldout", 64), spec["split"])
    except PipelineError as err:
        raise PipelineError(f"params.yaml data.arithmetic.{err}") from None
    return [dict(problem, dataset=f"{GENERATED}_{level}_{spec['split']}")
            for problem in problems[:spec.get("limit")]]


@stage_main
def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.prepare_data",
                                     description=__doc__.splitlines()[0])
    parser.parse_args(argv)  # no arguments (everything comes from params.yaml); --help works
    params = load_params()
    mirror = section(params, "data").get("mirror_dir")
    entries = [(group, name, spec) for group in ("rl", "eval")
               for name, spec in section(params, "data", group).items()]
    settings, levels = arithmetic_levels(params)
    for group, name, spec in entries:
        check_entry(f"params.yaml data.{group}.{name}", spec, levels)
    with tracking.stage_run("prepare_data", params=params):
        # Everything is loaded before anything is written: a bad dataset leaves every output as it was.
        loaded = [(group, name, spec["source"], problems_of(spec, mirror, settings, levels))
                  for group, name, spec in entries]
        with publish_together() as outputs:   # every set, or none
            for group, name, _, problems in loaded:
                outputs.write_jsonl(f"data/{group}/{name}.jsonl", problems)
        for group, name, source, problems in loaded:
            tracking.log_metrics({f"{group}.{name}.problems": len(problems)})
            log.info(f"data/{group}/{name}.jsonl: {len(problems)} problems from {source}")


if __name__ == "__main__":
    main(sys.argv[1:])
