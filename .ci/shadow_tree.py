"""Build a shadow tree of the moescope namespace: one folder `moescope/` as the installed package has it.

The repository keeps probe/, store/, alerts/ and dashboard/ beside moescope/, and setuptools maps them
into one namespace (`[tool.setuptools.package-dir]` in pyproject.toml: probe/ is `moescope.probe`). The
tools that walk a package's folder cannot follow that mapping in an editable install: import-linter's
graph (`.ci/lint-imports`), mypy (`.ci/typecheck`) and griffe, mkdocstrings' loader (`docs/hooks.py`).
So each of them reads this tree instead, first on its path:

    python .ci/shadow_tree.py DIR        # builds DIR/moescope and prints its path

`DIR/moescope/` is a folder of links: to every entry of the repository's moescope/, and to each folder
pyproject maps into the namespace, under its name there. A folder of scripts without an `__init__.py`
(the dashboard's pages, `dashboard/views/`, which Streamlit runs by path) would be skipped by all three
tools: in the tree it is a real folder of links to its scripts with an empty `__init__.py` added, and
the folders above it are real folders too, so the pages' imports are checked like any module's. Every
other folder is one link, whatever it holds (a subpackage such as `dashboard/figures/` included).

The tree is built afresh each time (a module moved or removed leaves no stale link).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
SKIPPED = {"__pycache__"}


def namespace_folders(repo: Path = REPO) -> dict[str, Path]:
    """Each package of the namespace that lives in a folder of its own -> that folder.

    Returns:
        e.g. {"probe": REPO/"probe", ...}: pyproject's package-dir mapping, the root package left out.
    """
    package_dir = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name.removeprefix("moescope."): repo / folder for name, folder in package_dir.items()
            if name.startswith("moescope.")}


def build(shadow: Path, repo: Path = REPO) -> Path:
    """Builds `shadow/moescope/` afresh (what was there is removed first).

    Args:
        shadow: the folder to build the tree in; it is created if missing.
        repo: the repository whose moescope/ and mapped folders the tree links.

    Returns:
        The shadow package folder, `shadow/moescope`.
    """
    package = shadow / "moescope"
    if package.is_symlink() or package.is_file():
        package.unlink()
    elif package.exists():
        shutil.rmtree(package)  # removes the links, never what they point to
    package.mkdir(parents=True)
    entries = {entry.name: entry for entry in (repo / "moescope").iterdir() if entry.name not in SKIPPED}
    entries.update(namespace_folders(repo))
    for name, source in sorted(entries.items()):
        _mirror(source, package / name)
    return package


def _mirror(source: Path, target: Path) -> None:
    if not source.is_dir() or not _holds_scripts_folder(source):
        target.symlink_to(source.resolve(), target_is_directory=source.is_dir())
        return
    target.mkdir()
    for entry in source.iterdir():
        if entry.name not in SKIPPED:
            _mirror(entry, target / entry.name)
    if not (source / "__init__.py").exists():
        (target / "__init__.py").touch()


def _holds_scripts_folder(folder: Path) -> bool:
    """Whether `folder`, or a folder under it, holds Python scripts without an `__init__.py`."""
    for _root, dirs, files in os.walk(folder):
        if "__init__.py" not in files and any(name.endswith(".py") for name in files):
            return True
        dirs[:] = [d for d in dirs if d not in SKIPPED]
    return False


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python .ci/shadow_tree.py DIR", file=sys.stderr)
        return 2
    print(build(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
