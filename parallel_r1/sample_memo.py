"""Evaluation samples found again by what decides them: the weights' values and the sampling settings.

An RL run whose every group got the same reward (the rule for a 135M model on DAPO: every answer
wrong) has zero advantages and ends with its starting weights, so its evaluation samples exactly
what its init's evaluation sampled: generation is a function of the weights, the tokenizer, the
prompts and the sampling settings (every job's seed derives from its key). `stages.evaluate` looks
the memo up before it starts an engine and stores each evaluation it completes, so an identical one
costs a file read instead of minutes of decoding, and its log names the model whose samples it
shares.

The key hashes tensor *values* as float32 (plus the config and tokenizer files), not file names,
sizes or mtimes like the partial files' stamp: a copied or re-saved checkpoint (the base model is
stored in bf16, an RL model saved from float32 masters) hits, and any changed weight misses.
Scoring is never memoised; it runs on the samples each time. Entries live in data/memo/eval/
(outside every stage's outputs, like data/partial/) and never go stale: a key names its inputs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Mapping, Sequence

from parallel_r1.evaluation import Job, Sample, sample_from_row
from parallel_r1.io import read_json, write_json

MEMO_DIR = Path("data/memo/eval")
# Files besides the weights that change what a model generates (the tokenizer renders the prompts)
DEFINING_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "vocab.json",
                  "merges.txt", "tokenizer.model")

CONFIG_STORAGE_KEYS = ("dtype", "torch_dtype", "transformers_version")

SampleKey = tuple[str, str, int]  # Job.key


def model_digest(folder: Path) -> str:
    """sha256 of the folder's tensors (name, shape, float32 values, in name order) and defining files."""
    import torch
    from safetensors import safe_open

    digest = hashlib.sha256()
    for weights in sorted(folder.glob("*.safetensors")):
        with safe_open(str(weights), framework="pt") as tensors:
            for name in sorted(tensors.keys()):
                tensor = tensors.get_tensor(name).to(torch.float32).contiguous()
                digest.update(f"{name}:{tuple(tensor.shape)}".encode())
                digest.update(tensor.view(torch.uint8).numpy().tobytes())
    for name in DEFINING_FILES:
        if (folder / name).is_file():
            digest.update(name.encode())
            digest.update(_defining_bytes(folder / name))
    return digest.hexdigest()


def _defining_bytes(path: Path) -> bytes:
    """The file's bytes; of a model config, without the storage dtype (the engine loads the weights in
    evaluate's dtype whatever they were saved in) and the writer's transformers version."""
    if path.name != "config.json":
        return path.read_bytes()
    config = {key: value for key, value in json.loads(path.read_text(encoding="utf-8")).items()
              if key not in CONFIG_STORAGE_KEYS}
    return json.dumps(config, sort_keys=True).encode()


def memo_key(folder: Path, settings: Mapping, jobs: Sequence[Job]) -> str:
    """The key of an evaluation: model digest, sampling `settings` (JSON-able) and every job's prompt."""
    job_list = [[*job.key, list(job.prompt_ids)] for job in jobs]
    text = json.dumps([model_digest(folder), settings, job_list], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def memo_path(key: str) -> Path:
    return MEMO_DIR / f"{key}.json"


def load(key: str, jobs: Sequence[Job]) -> tuple[dict[SampleKey, Sample], str] | None:
    """({Job.key: sample}, the model that produced them) when `key` is stored with every job's sample."""
    path = memo_path(key)
    if not path.is_file():
        return None
    entry = read_json(path)
    samples = {}
    for index, row in enumerate(entry["samples"]):
        sample = sample_from_row(row, f"{path}: sample {index}")
        samples[(row["benchmark"], str(sample.problem_id), sample.sample_index)] = sample
    if any(job.key not in samples for job in jobs):
        return None
    return samples, str(entry["model"])


def store(key: str, model: str, jobs: Sequence[Job], samples: Mapping[SampleKey, Sample]) -> None:
    """Keep the samples of a completed evaluation of `model` under `key` (written atomically)."""
    rows = [{"benchmark": job.benchmark, **dataclasses.asdict(samples[job.key])} for job in jobs]
    write_json(memo_path(key), {"model": model, "samples": rows})
