"""Stage `generate@<dataset>`: zero-shot teacher outputs with the Parallel Thinking prompt.

    dvc repro generate@gsm8k          # or generate@dapo
    python -m stages.generate gsm8k

`source: model` generates with the teacher through the rollout engine in plain (non-forking) mode — the engine
of `generate.engine` (vllm: offline `LLM`, prefix caching on; auto: vLLM where it is installed and CUDA is
present, else transformers) — and keeps only the output after the teacher's hidden thinking. `source:
released` takes the authors' released generations (the mirror's teacher_demos_gsm8k.jsonl). Finished chunks
are appended to a partial file (data/partial/teacher/<dataset>.jsonl, outside data/teacher/ where readers
glob), so a killed run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from parallel_r1 import tracking
from parallel_r1.data import TEACHER_DEMOS, TEACHER_DEMOS_MODEL, load_problems, load_teacher_demos
from parallel_r1.errors import PipelineError
from parallel_r1.io import read_jsonl, write_jsonl
from parallel_r1.models import load_tokenizer, resolve_model_source
from parallel_r1.prompts import render_prompt, user_message
from parallel_r1.teacher import strip_thinking, teacher_record
from stages.common import load_params, log, section, stage_main

BASE_MODEL = "models/base"   # its tokenizer counts completion tokens for the SFT length cap
# Finished chunks of a killed run, kept outside data/teacher/: a `dvc checkout` restores the outputs there,
# and every reader of data/teacher/*.jsonl (validate, filter) would take a partial file for a dataset.
PARTIAL_DIR = Path("data/partial/teacher")


def partial_path(name: str) -> Path:
    """Where generate@<name> appends its finished chunks (a partial file of an older version, beside the
    output as data/teacher/.<name>.partial.jsonl, is moved here, so its chunks are still resumed)."""
    path = PARTIAL_DIR / f"{name}.jsonl"
    legacy = Path(f"data/teacher/.{name}.partial.jsonl")
    if legacy.is_file():
        if path.exists():
            legacy.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            legacy.replace(path)
    return path
CHUNK = 256                  # prompts per engine call: the unit of progress and of resuming


def released_rows(mirror, limit, tokenizer) -> list[dict]:
    source = f"{TEACHER_DEMOS_MODEL} ({TEACHER_DEMOS.mirror_file} / {TEACHER_DEMOS.hub_id})"
    rows = []
    for demo in load_teacher_demos(mirror, limit):
        tokens = len(tokenizer(demo["completion"], add_special_tokens=False)["input_ids"])
        prompt = demo["prompt"] or user_message(demo["question"])
        rows.append(teacher_record(demo, prompt, demo["completion"], "released", source, tokens, False))
    return rows


def model_rows(name: str, problems: list[dict], gen: dict, seed: int, student_tokenizer) -> list[dict]:
    from parallel_r1.engine import make_engine
    from parallel_r1.engine.base import RolloutConfig

    teacher = resolve_model_source(str(gen["teacher"]), "generate.teacher")
    teacher_tokenizer = load_tokenizer(teacher)
    partial = partial_path(name)
    done = {row["id"]: row for row in read_jsonl(partial, allow_empty=True)} if partial.exists() else {}
    todo = [p for p in problems if p["id"] not in done]
    if done:
        log.info(f"resuming: {len(done)} outputs already in {partial}, {len(todo)} to go")
    config = RolloutConfig(parallel=False, max_tokens=int(gen["max_tokens"]),
                           temperature=float(gen["temperature"]),
                           top_p=float(gen["top_p"]), seed=seed)
    engine = make_engine(gen.get("engine", "auto"), teacher, teacher_tokenizer, config,
                         gpu_memory_utilization=gen.get("gpu_memory_utilization"),
                         enforce_eager=gen.get("enforce_eager"),
                         memory_param="params.yaml generate.gpu_memory_utilization")
    partial.parent.mkdir(parents=True, exist_ok=True)
    with open(partial, "a", encoding="utf-8") as sink:
        for start in tqdm(range(0, len(todo), CHUNK), desc=f"teacher {name}", unit="chunk", file=sys.stdout):
            chunk = todo[start:start + CHUNK]
            prompts = [render_prompt(teacher_tokenizer, p["question"]) for p in chunk]
            prompt_ids = [teacher_tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
            for problem, prompt, rollout in zip(chunk, prompts, engine.generate(prompt_ids, 1), strict=True):
                completion, unfinished = strip_thinking(rollout.text)
                tokens = len(student_tokenizer(completion, add_special_tokens=False)["input_ids"])
                row = teacher_record(problem, prompt, completion, "model", str(gen["teacher"]), tokens,
                                     rollout.truncated or unfinished)
                done[row["id"]] = row
                sink.write(json.dumps(row, ensure_ascii=False) + "\n")
            sink.flush()
    return [done[p["id"]] for p in problems]


@stage_main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.generate", description=__doc__.splitlines()[0])
    parser.add_argument("dataset", nargs="?", help="a key of params.yaml generate_datasets")
    name = parser.parse_args(argv).dataset
    params = load_params()
    gen = section(params, "generate")
    datasets = section(params, "generate_datasets")
    if name not in datasets:  # the names live in params.yaml: checked here, in one line
        raise PipelineError(f"usage: python -m stages.generate <dataset> (one of {', '.join(datasets)})")
    spec = datasets[name]
    limit = spec.get("limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise PipelineError(f"params.yaml generate_datasets.{name}.limit: must be an integer >= 0 or null, "
                            f"got {limit!r}")
    if "source" not in spec:
        raise PipelineError(f"params.yaml generate_datasets.{name}: missing key 'source'")
    if spec["source"] not in ("model", "released"):
        raise PipelineError(f"params.yaml generate_datasets.{name}.source: expected 'model' or 'released', "
                            f"got {spec['source']!r}")
    mirror = section(params, "data").get("mirror_dir")
    tags = {"source": spec.get("source"),
            "teacher": gen.get("teacher") if spec.get("source") == "model" else None}
    with tracking.stage_run("generate", name, params, tags=tags):
        tokenizer = load_tokenizer(BASE_MODEL)
        if spec.get("source") == "released":
            rows = released_rows(mirror, limit, tokenizer)
        else:
            problems = load_problems(section(params, "generate_datasets", name, "problems"), mirror,
                                     limit)
            rows = model_rows(name, problems, gen, int(params.get("seed", 0)), tokenizer)
        count = write_jsonl(f"data/teacher/{name}.jsonl", rows)
        partial_path(name).unlink(missing_ok=True)
        log.info(f"data/teacher/{name}.jsonl: {count} teacher outputs")
        tokens = sum(row["completion_tokens"] for row in rows)
        tracking.log_metrics({"outputs": count, "truncated": sum(row["truncated"] for row in rows),
                              "mean_completion_tokens": tokens / max(count, 1)})


if __name__ == "__main__":
    main()
