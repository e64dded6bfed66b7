"""The README stays a map of what is there: its module map names every library module (and nothing gone),
its profile table every profile conf/profile/ holds, and it stays short enough to read."""

from __future__ import annotations

import re
from pathlib import Path

from stages.profiles import profile_names

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    """The README's text from the heading `## <title>` to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.M | re.S)
    assert match, f"README.md: no '## {title}' section"
    return match.group(1)


def test_module_map_names_every_library_module_and_no_missing_one():
    layout = section("Layout")
    named = set(re.findall(r"\b([a-z_]+\.(?:py|yaml))\b", layout))
    library = {path.name for path in (REPO / "parallel_r1").glob("*.py") if path.name != "__init__.py"}
    library |= {path.name for path in (REPO / "parallel_r1").glob("*.yaml")}
    assert library - named == set(), "modules missing from the README's Layout"
    everywhere = {path.name for folder in ("parallel_r1", "stages", "flows", "requirements")
                  for path in (REPO / folder).rglob("*")}
    stray = {name for name in named if name not in everywhere and not (REPO / name).exists()}
    assert stray == set(), "README's Layout names modules that do not exist"
    folders = {path.name for path in (REPO / "parallel_r1").iterdir() if (path / "__init__.py").is_file()}
    assert all(f"{folder}/" in layout for folder in folders)


def test_profile_table_lists_exactly_the_profiles_in_conf():
    table = [line for line in section("Profiles").splitlines() if line.startswith("| `")]
    listed = sorted(re.match(r"\| `([a-z0-9_]+)`", line).group(1) for line in table)
    assert listed == profile_names(REPO)


def test_readme_stays_short():
    assert len(README.splitlines()) <= 250
