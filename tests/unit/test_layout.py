"""The layout holds: what users import still resolves, every package is in the wheel's list, and the
tests keep to their tiers (no test module imports another; helpers live in tests/support)."""

from __future__ import annotations

import ast
import importlib
import os
import sys

import pytest

from tests.support.paths import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# every package a user imports: each states its names in __all__ and has a page in the API reference
PUBLIC_PACKAGES = ("moescope", "moescope.core", "moescope.probe", "moescope.store", "moescope.metrics",
                   "moescope.ingest", "moescope.alerts", "moescope.analyses", "moescope.prometheus",
                   "moescope.dashboard", "moescope.training")
# packages inside a room's face, with an __all__ of their own
INNER_PACKAGES = ("moescope.ingest.importers", "moescope.ingest.proxy")
# issue 46: these packages get their __all__ on another branch (the placement work); the lead empties this
# set when merging it
# package-dir of pyproject: the repository's folders that install under the moescope namespace
FOLDERS = {"moescope": "moescope", "moescope.probe": "probe", "moescope.store": "store",
           "moescope.alerts": "alerts", "moescope.dashboard": "dashboard"}


@pytest.mark.parametrize("package", PUBLIC_PACKAGES + INNER_PACKAGES)
def test_every_name_a_package_exports_resolves(package):
    module = importlib.import_module(package)
    for name in getattr(module, "__all__", ()):
        if getattr(module, name, None) is None:  # a submodule listed in __all__ (`from package import *` loads it)
            importlib.import_module(f"{package}.{name}")


def _nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    return [page for item in node for page in _nav_pages(item)]


def test_every_public_package_states_its_names_and_has_a_page_in_the_api_reference():
    """A package's page renders its __all__ (`::: package`), so a name added there is documented at the next
    build; the page is listed in mkdocs.yml's nav."""
    import yaml

    with open(os.path.join(REPO, "mkdocs.yml"), encoding="utf-8") as fh:
        text = "\n".join(line for line in fh if "!relative" not in line)  # a tag only mkdocs resolves
    nav = set(_nav_pages(yaml.safe_load(text)["nav"]))
    api = os.path.join(REPO, "docs", "reference", "api")
    rendered = {}
    for name in os.listdir(api):
        with open(os.path.join(api, name), encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("::: "):
                    rendered.setdefault(line[4:].strip(), f"reference/api/{name}")
    problems = []
    for package in PUBLIC_PACKAGES:
        if not isinstance(getattr(importlib.import_module(package), "__all__", None), list):
            problems.append(f"{package} has no __all__ list")
        page = rendered.get(package)
        if page is None:
            problems.append(f"no page under docs/reference/api renders `::: {package}`")
        elif page not in nav:
            problems.append(f"{page} ({package}) is not in mkdocs.yml's nav")
    assert not problems, "\n".join(problems)


def test_what_users_were_told_to_import_is_the_same_object_as_its_home():
    import moescope
    import moescope.alerts
    import moescope.probe
    import moescope.prometheus
    import moescope.store
    from moescope.alerts.engine import AlertEngine
    from moescope.attachment import attach
    from moescope.core.exporters import InMemoryExporter
    from moescope.probe.session import attach as probe_attach
    from moescope.prometheus.exporter import PrometheusExporter
    from moescope.store.store import Store

    assert moescope.attach is attach
    assert moescope.Store is moescope.store.Store is Store
    assert moescope.probe.attach is probe_attach
    assert not hasattr(moescope.store, "InMemoryExporter") and InMemoryExporter.__module__ == "moescope.core.exporters"
    assert moescope.alerts.AlertEngine is AlertEngine
    assert moescope.alerts.PrometheusExporter is PrometheusExporter  # the lazy alias of an old home
    assert "PrometheusExporter" not in moescope.alerts.__all__  # ... which is not one of alerts' names
    assert moescope.prometheus.PrometheusExporter is PrometheusExporter


def test_the_command_line_offers_every_command_group():
    from moescope.cli import build_parser

    parser = build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert {"demo", "summary", "train-demo", "query", "compact", "prune", "store", "import", "proxy", "alerts",
            "dashboard", "grafana", "jitter", "whatif"} <= commands


def _python_packages() -> set[str]:
    """Every folder with an __init__.py under the namespace's folders, as its installed package name."""
    found = set()
    for package, folder in FOLDERS.items():
        for root, dirs, files in os.walk(os.path.join(REPO, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            if "__init__.py" in files:
                relative = os.path.relpath(root, os.path.join(REPO, folder))
                found.add(package if relative == "." else f"{package}.{relative.replace(os.sep, '.')}")
    return found


def test_the_wheel_lists_every_package():
    """pyproject lists the packages by hand (the folders map into one namespace): a package missing
    there installs from an editable checkout and is absent from the wheel."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        listed = set(tomllib.load(fh)["tool"]["setuptools"]["packages"])
    assert _python_packages() == listed


def _test_modules() -> list[str]:
    out = []
    for root, dirs, files in os.walk(os.path.join(REPO, "tests")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out += [os.path.join(root, f) for f in files if f.endswith(".py")]
    return out


def test_every_test_lives_in_a_tier_and_no_module_imports_a_test_module():
    tiers = {"unit", "integration", "e2e"}
    problems = []
    for path in _test_modules():
        relative = os.path.relpath(path, os.path.join(REPO, "tests")).split(os.sep)
        name = relative[-1]
        if name.startswith("test_") and relative[0] not in tiers:
            problems.append(f"{'/'.join(relative)} is outside tests/unit, tests/integration and tests/e2e")
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            for module in modules:
                parts = module.split(".")
                if parts[0] == "tests" and (len(parts) > 1 and parts[1] in tiers or "conftest" in parts):
                    problems.append(f"{'/'.join(relative)} imports {module}: shared helpers belong in tests/support")
    assert not problems, "\n".join(problems)


def _shadow_tree_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("shadow_tree", os.path.join(REPO, ".ci", "shadow_tree.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shadow_tree_holds_the_namespace_as_it_installs(tmp_path):
    """The tree .ci/lint-imports, .ci/typecheck and the manual's build read: moescope/ with every folder pyproject
    maps into it, and the dashboard's pages (scripts without an __init__.py) as a package."""
    shadow_tree = _shadow_tree_module()
    (tmp_path / "moescope" / "stale.py").parent.mkdir()
    (tmp_path / "moescope" / "stale.py").write_text("")  # a tree built before: rebuilt afresh
    package = shadow_tree.build(tmp_path)
    assert package == tmp_path / "moescope"
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        mapped = tomllib.load(fh)["tool"]["setuptools"]["package-dir"]
    assert os.path.samefile(package / "__init__.py", os.path.join(REPO, "moescope", "__init__.py"))
    for name, folder in mapped.items():
        if name != "moescope":
            inside = package.joinpath(*name.split(".")[1:], "__init__.py")
            assert os.path.samefile(inside, os.path.join(REPO, folder, "__init__.py")), name
    assert not (package / "stale.py").exists()
    assert (package / "core").is_symlink() and (package / "store").is_symlink()  # no script folder inside
    views = package / "dashboard" / "views"
    assert not views.is_symlink() and (views / "__init__.py").is_file()
    pages = sorted(f for f in os.listdir(os.path.join(REPO, "dashboard", "views")) if f.endswith(".py"))
    assert pages and sorted(f for f in os.listdir(views) if f != "__init__.py") == pages
    assert os.path.samefile(views / pages[0], os.path.join(REPO, "dashboard", "views", pages[0]))
    assert not os.path.exists(os.path.join(REPO, "dashboard", "views", "__init__.py"))  # the repository is untouched
