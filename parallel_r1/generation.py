"""Resumable sampling: a long generation appends each finished chunk to a partial file and, killed, goes on
from it instead of starting over.

Used by the evaluation stage (`stages/evaluate.py`: every benchmark of a model, the scaffold curve's
snapshots). A partial row carries the stamp of the work it belongs to (`identity.identity_stamp`: the
checkpoint's files and the sampling settings), so a kill followed by a retrained model or new settings
never completes an evaluation with old samples. The partial file must lie outside the stage's DVC outputs,
which DVC deletes before it re-runs a stage; the caller deletes it once its outputs are written.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Mapping, Sequence

from tqdm import tqdm

from parallel_r1 import sample_memo, tracking
from parallel_r1.evaluation import Job, Sample, generate_jobs, sample_from_row
from parallel_r1.io import read_jsonl_lines

CHUNK = 256                               # samples per engine call: the unit of progress and of resuming

SampleKey = tuple[str, str, int]           # Job.key: (benchmark, problem id, sample index)
_log = logging.getLogger(__name__)


def read_partial(path: Path, log: logging.Logger = _log) -> list[tuple[int, dict]]:
    """The rows a killed generation appended to `path` (none when there is no file).

    A kill mid-write leaves a last line without its newline: it is cut off the file, with a warning,
    so that appending goes on from a whole line. Any other bad line is an error naming it.
    """
    if not path.is_file():
        return []
    data = path.read_bytes()
    whole = data.rfind(b"\n") + 1
    if whole < len(data):
        log.warning(f"{path}: dropping its unfinished last line ({len(data) - whole} bytes, killed "
                    "mid-write)")
        os.truncate(path, whole)
    return read_jsonl_lines(path, required=("benchmark", "stamp"), allow_empty=True) if whole else []


def generate_resumably(jobs: Sequence[Job], partial: Path, run_stamp: str, start_engine: Callable,
                       desc: str, log: logging.Logger = _log) -> dict[SampleKey, Sample]:
    """{Job.key: sample} for every job, CHUNK per engine call, each finished chunk appended to `partial`.

    Samples already in `partial` are reused when their key is among the jobs and their stamp matches;
    others (another k, benchmark set, checkpoint or setting) are ignored. The engine is only started
    when something is left to generate, so a resumed scaffold curve skips its finished snapshots.
    """
    keys = {job.key for job in jobs}
    done: dict[SampleKey, Sample] = {}
    rows = read_partial(partial, log)
    for lineno, row in rows:
        sample = sample_from_row(row, f"{partial}:{lineno}")
        key = (row["benchmark"], str(sample.problem_id), sample.sample_index)
        if row["stamp"] == run_stamp and key in keys:
            done[key] = sample
    todo = [job for job in jobs if job.key not in done]
    if rows:
        stale = len(rows) - len(done)
        ignored = f" ({stale} rows of another setting, checkpoint or job set ignored)" if stale else ""
        log.info(f"resuming: {len(done)} samples already in {partial}, {len(todo)} to go{ignored}")
    if not todo:
        return done
    engine = start_engine()
    partial.parent.mkdir(parents=True, exist_ok=True)
    try:
        for start in tqdm(range(0, len(todo), CHUNK), desc=desc, unit="chunk", file=sys.stdout):
            chunk, lines = todo[start:start + CHUNK], []
            for job, sample in zip(chunk, generate_jobs(engine, chunk), strict=True):
                done[job.key] = sample
                row = {"benchmark": job.benchmark, "stamp": run_stamp, **dataclasses.asdict(sample)}
                lines.append(json.dumps(row, ensure_ascii=False) + "\n")
            # opened once a chunk is finished: a run killed before its first chunk leaves no empty file
            with open(partial, "a", encoding="utf-8") as sink:
                sink.write("".join(lines))
    finally:
        engine.close()
    return done


def memoised_samples(folder: Path, jobs: Sequence[Job], settings: Mapping, run_stamp: str,
                     start_engine: Callable, partial: Path, desc: str,
                     log: logging.Logger = _log) -> dict[SampleKey, Sample]:
    """The jobs' samples: from the memo when these weights were evaluated with these `settings` (prompt,
    rollout config, dtype, engine and its options) before -- an RL run that never got a reward spread
    keeps its init's weights (`sample_memo`) -- else generated (resumably, into `partial`) and, unless
    resumed from a partial file (whose rows were drawn under other seeds), stored in the memo."""
    key = sample_memo.memo_key(folder, dict(settings), jobs)
    found = sample_memo.load(key, jobs) if key is not None else None
    if found is not None:
        samples, source = found
        what = "already evaluated" if source == str(folder) else f"identical to {source}'s evaluation"
        log.info(f"{folder}: weights and sampling settings {what}: its {len(jobs)} samples reused "
                 f"({sample_memo.memo_path(str(key))})")
        is_snapshot = folder.parent.name == "steps"
        tag = f"samples_reused_from.{folder.name}" if is_snapshot else "samples_reused_from"
        tracking.set_tags({tag: source})
        return samples
    resumed = partial.is_file() and partial.stat().st_size > 0
    samples = generate_resumably(jobs, partial, run_stamp, start_engine, desc, log)
    if key is not None and not resumed:
        sample_memo.store(key, str(folder), jobs, samples)
    return samples
