"""Every Python package folder of the source tree is in pyproject.toml's `packages` list: an editable install finds
an unlisted one anyway, a normal install (the container image's) leaves it out and fails at import."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for package, folder in tool["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]))
    assert found - listed == set(), f"package folders missing from pyproject.toml's packages: {sorted(found - listed)}"
    assert listed - found == set(), f"listed packages without a folder: {sorted(listed - found)}"
