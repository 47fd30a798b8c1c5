"""Print what pip resolved for an extra of the project: each requirement the extra names, and what
that requirement's own extras pull in (dask[dataframe,distributed] -> distributed), one line each.

    python .ci/versions.py test

A broken pair (dask 2026.11.0 beside distributed 2021.4.1) then shows in the CI log above the first
failure it causes, instead of as an ImportError deep in a test.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def resolved(extra: str, pyproject: Path) -> list[tuple[str, str, str]]:
    """(name, installed version, why) for every requirement of `extra` and of the extras those name."""
    project = tomllib.loads(pyproject.read_text())["project"]
    rows: dict[str, tuple[str, str, str]] = {}
    for line in project["optional-dependencies"][extra]:
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        rows.setdefault(name, (name, _version(name), str(requirement.specifier) or "any"))
        if not requirement.extras or _version(name) == "not installed":
            continue
        for dependency in metadata.requires(name) or []:
            inner = Requirement(dependency)
            wanted = any(inner.marker is not None and inner.marker.evaluate({"extra": e})
                         for e in requirement.extras)
            inner_name = canonicalize_name(inner.name)
            if wanted and inner_name not in rows:
                rows[inner_name] = (inner_name, _version(inner_name),
                                    f"{inner.specifier or 'any'} (from {name}[{','.join(sorted(requirement.extras))}])")
    return sorted(rows.values())


def main(argv: list[str]) -> int:
    extra = argv[0] if argv else "test"
    rows = resolved(extra, Path(__file__).resolve().parent.parent / "pyproject.toml")
    width = max(len(name) for name, _, _ in rows)
    print(f"resolved versions of the [{extra}] extra:")
    for name, version, wanted in rows:
        print(f"  {name:<{width}}  {version:<14} wanted {wanted}")
    return 1 if any(version == "not installed" for _, version, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
