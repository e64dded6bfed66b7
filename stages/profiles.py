"""params.yaml from conf/: one complete file per profile, composed as DVC's Hydra integration does.

    python -m stages.profiles paper       # params.yaml <- conf/pipeline.yaml + conf/profile/paper.yaml
    python -m stages.profiles --check     # does params.yaml equal its profile's composition?
    dvc exp run -S profile=tiny           # DVC composes the same way for an experiment (.dvc/config [hydra])

Every stage and dvc.yaml read params.yaml and nothing else, so DVC and the stages always see the same
values and dvc.yaml names each key once. A profile is read in one place, conf/profile/<name>.yaml (every
knob); conf/pipeline.yaml holds what is the same in every profile (the RL configurations, the models
evaluated, the report rows, tracking). params.yaml is generated but committed: DVC tracks its keys.

Switching refuses to overwrite hand edits of params.yaml (values that differ from its own profile's
composition) unless `--force`: a switch never loses a change silently.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import yaml

from parallel_r1.errors import PipelineError
from stages.common import PARAMS_FILE, read_params_yaml, stage_main

CONFIG_DIR = "conf"
CONFIG_NAME = "config"


def profile_names(root: str | os.PathLike = ".") -> list[str]:
    """The profiles conf/profile/ holds (file stems), sorted."""
    return sorted(path.stem for path in (Path(root) / CONFIG_DIR / "profile").glob("*.yaml"))


def _check_profile(root: Path, profile: str) -> None:
    names = profile_names(root)
    if profile not in names:
        raise PipelineError(f"{CONFIG_DIR}/profile/{profile}.yaml: no such profile "
                            f"(choose from {', '.join(names)})")


def compose(root: str | os.PathLike = ".", profile: str | None = None,
            overrides: list[str] | None = None) -> dict:
    """The parameters `profile` (default: conf/config.yaml's) composes to, with Hydra `overrides`,
    interpolations resolved."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    root = Path(root).resolve()
    if profile is not None:
        _check_profile(root, profile)
    chosen = [f"profile={profile}"] if profile else []
    try:
        with initialize_config_dir(str(root / CONFIG_DIR), version_base=None):
            config = hydra_compose(config_name=CONFIG_NAME, overrides=[*chosen, *(overrides or [])])
        return OmegaConf.to_container(config, resolve=True)  # type: ignore[return-value]
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as err:
        raise PipelineError(f"{CONFIG_DIR}/: cannot compose profile {profile or 'default'} "
                            f"({str(err).strip().splitlines()[0]})") from None


def write_params(root: str | os.PathLike = ".", profile: str | None = None,
                 overrides: list[str] | None = None) -> Path:
    """Compose `profile` into params.yaml, byte for byte as `dvc exp run -S profile=<name>` writes it."""
    from dvc.utils.hydra import compose_and_dump
    from hydra.errors import HydraException

    root = Path(root).resolve()
    if profile is not None:
        _check_profile(root, profile)
    chosen = [f"profile={profile}"] if profile else []
    out = root / PARAMS_FILE
    try:
        compose_and_dump(out, str(root / CONFIG_DIR), None, CONFIG_NAME, str(root),
                         [*chosen, *(overrides or [])])
    except HydraException as err:
        raise PipelineError(f"{CONFIG_DIR}/: cannot compose profile {profile or 'default'} "
                            f"({str(err).strip().splitlines()[0]})") from None
    return out


def differences(expected: Any, actual: Any, where: str = "") -> list[str]:
    """Dotted keys whose values differ between two parameter trees (missing on either side included)."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        found: list[str] = []
        for key in dict.fromkeys([*expected, *actual]):
            path = f"{where}.{key}" if where else str(key)
            if key not in expected or key not in actual:
                found.append(path)
            else:
                found += differences(expected[key], actual[key], path)
        return found
    return [] if expected == actual else [where or "(root)"]


def edits(root: str | os.PathLike = ".") -> list[str]:
    """Keys of params.yaml that differ from its own profile's composition (hand edits, or a stale file);
    none in a DVC project without conf/ (params.yaml is then the only source)."""
    root = Path(root)
    if not (root / CONFIG_DIR / f"{CONFIG_NAME}.yaml").is_file():
        return []
    current = read_params_yaml(root / PARAMS_FILE)
    return differences(compose(root, current.get("profile")), current)


def switch(root: str | os.PathLike, profile: str, force: bool = False) -> Path:
    """Make `profile` the one params.yaml holds; refuses to drop hand edits unless `force`."""
    root = Path(root)
    _check_profile(root, profile)
    if (root / PARAMS_FILE).is_file() and not force:
        changed = edits(root)
        if changed:
            raise PipelineError(f"{PARAMS_FILE}: {len(changed)} value(s) differ from its profile's "
                                f"composition (first: {changed[0]}); move them to {CONFIG_DIR}/profile/ "
                                "or pass --force")
    return write_params(root, profile)


@stage_main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.profiles", description=__doc__.splitlines()[0])
    parser.add_argument("profile", nargs="?", help="profile to compose into params.yaml")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if params.yaml differs from its composition")
    parser.add_argument("--force", action="store_true",
                        help="switch even if params.yaml has hand edits")
    args = parser.parse_args(argv)
    root = Path.cwd()
    if args.check:
        changed = edits(root)
        if changed:
            more = " ..." if len(changed) > 5 else ""
            raise PipelineError(f"{PARAMS_FILE} differs from its profile's composition at "
                                f"{', '.join(changed[:5])}{more} (run python -m stages.profiles <profile>)")
        profile = read_params_yaml(root / PARAMS_FILE)["profile"]
        print(f"{PARAMS_FILE} is the composition of profile {profile}")
        return
    if not args.profile:
        parser.error(f"give a profile ({', '.join(profile_names(root))}) or --check")
    from parallel_r1.project_lock import project_lock  # the entry points' lock, taken here too

    with project_lock(root):   # not under a running pipeline's feet
        switch(root, args.profile, force=args.force)
    print(f"{PARAMS_FILE}: profile {args.profile} "
          f"({CONFIG_DIR}/pipeline.yaml + {CONFIG_DIR}/profile/{args.profile}.yaml)")


if __name__ == "__main__":
    main()
