"""A model folder's identity by value: what it computes, not how its files were written.

The memos (`sample_memo` for evaluations, `training/run_memo` for RL runs) key on it, and on
`environment`: the code, libraries and device that turn the same inputs into the same outputs.
The digest hashes tensor *values* as float32 plus the files that change what a model generates
(config and tokenizer), not file names, sizes or mtimes: a re-saved checkpoint (the base model is
stored in bf16, an RL model saved from float32 masters) has the digest it had, and any changed
weight changes it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

# Files besides the weights that change what a model generates (the tokenizer renders the prompts)
DEFINING_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "vocab.json",
                  "merges.txt", "tokenizer.model")
CONFIG_STORAGE_KEYS = ("dtype", "torch_dtype", "transformers_version")  # how it was saved, not what it does


def model_digest(folder: Path) -> str | None:
    """sha256 of the folder's tensors (name, shape, float32 values, in name order) and defining files;
    None when its weights are not all safetensors (a pickled .bin is not read here: no memo)."""
    import torch
    from safetensors import safe_open

    weights = sorted(folder.glob("*.safetensors"))
    if not weights or any(folder.glob("*.bin")):
        return None
    digest = hashlib.sha256()
    for path in weights:
        with safe_open(str(path), framework="pt") as tensors:
            for name in sorted(tensors.keys()):
                tensor = tensors.get_tensor(name).to(torch.float32).contiguous()
                digest.update(f"{name}:{tuple(tensor.shape)}".encode())
                digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
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


# The one policy of both memos for "the code that produced this": every module of the library (a change
# anywhere misses: the safe side). The stages' own files are not read: what a stage decides (options, prompt
# rows, sampling settings) reaches each key as data, and the library never depends on stages/.
LIBRARY_CODE = tuple(sorted(Path(__file__).resolve().parent.rglob("*.py")))


def memo_key(inputs: Sequence[Any], libraries: Iterable[str]) -> str:
    """sha256 of the JSON of `inputs` (what the caller decides the result by) and the `environment` of the
    library's code, the `libraries`' versions and the device."""
    text = json.dumps([*inputs, environment(LIBRARY_CODE, libraries)], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def environment(code: Iterable[Path], libraries: Iterable[str]) -> dict[str, Any]:
    """What besides the inputs decides a memoised result: a hash of the `code` files (name and bytes; a
    missing file hashes as empty), the `libraries`' installed versions (None: not installed), the device."""
    digest = hashlib.sha256()
    for path in code:
        digest.update(path.name.encode())
        digest.update(path.read_bytes() if path.is_file() else b"")
    versions: dict[str, str | None] = {}
    for name in libraries:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {"code": digest.hexdigest(), "versions": versions, "device": device_kernels()}


def device_kernels() -> str:
    """The device and the kernels its numerics come from: the GPU's name, or on a CPU the ATen kernel
    level (AVX512 / AVX2 / ...) and whether oneDNN has native bf16. Two CPUs that differ here sample
    different tokens from the same weights: bfloat16 is decoded only where it is native
    (`models.runs_in_bf16`), and the vectorised kernels sum in a different order."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return f"cpu:{torch.backends.cpu.get_cpu_capability()}:{'bf16' if bf16 else 'no-bf16'}"
