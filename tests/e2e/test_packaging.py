"""moescope installs as one namespace: the wheel, installed into a fresh virtual environment, adds
`moescope` and nothing else at the top level, so a user's own `store/` or `alerts/` package is
never shadowed by ours (nor ours by theirs).

The fresh environment gets the built wheel alone (`--no-deps`); its dependencies (torch,
transformers, pyarrow, ...) are borrowed from the test's own environment through PYTHONPATH, which
does not run that environment's `.pth` files, so the repository's editable install is not seen.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest

from tests.support.paths import REPO

SUBPACKAGES = ("probe", "store", "alerts", "dashboard")

pytestmark = [pytest.mark.slow, pytest.mark.integration]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    REPO], check=True, capture_output=True, timeout=300)
    (path,) = glob.glob(str(out / "moescope-*.whl"))
    return path


@pytest.fixture(scope="module")
def fresh_env(wheel, tmp_path_factory) -> tuple[str, dict[str, str]]:
    """A new venv holding the wheel alone; returns its python and the environment to run it in."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=300)
    python = str(root / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], check=True,
                   capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = sysconfig.get_paths()["purelib"]  # the dependencies, without our editable install
    return python, env


def test_the_wheel_has_one_top_level_package(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top = archive.read(next(n for n in names if n.endswith("top_level.txt"))).decode().split() \
            if any(n.endswith("top_level.txt") for n in names) else []
    roots = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert roots == {"moescope"}, roots
    assert top in ([], ["moescope"])
    for sub in SUBPACKAGES:
        assert f"moescope/{sub}/__init__.py" in names
    # data the package reads at run time travels in the wheel
    assert "moescope/alerts/default_rules.yaml" in names
    assert "moescope/demo/model/model.safetensors" in names and "moescope/demo/rules.yaml" in names
    assert "moescope/dashboard/views/overview.py" in names


def test_only_the_moescope_namespace_imports_in_a_fresh_env(fresh_env, tmp_path):
    python, env = fresh_env
    script = textwrap.dedent(f"""
        import importlib, sys
        for name in {SUBPACKAGES!r}:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError:
                pass
            else:
                sys.exit(f"import {{name}} worked: moescope leaked a top-level package")
        import moescope, moescope.store, moescope.alerts, moescope.probe, moescope.cli.dashboard
        assert moescope.__file__.startswith({str(os.path.dirname(os.path.dirname(python)))!r}), moescope.__file__
        assert sorted(moescope.__all__) == sorted(set(moescope.__all__))
        for name in moescope.__all__:
            getattr(moescope, name)
        print("ok")
    """)
    done = subprocess.run([python, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"

    cli = subprocess.run([os.path.join(os.path.dirname(python), "moescope"), "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert "moescope demo" in cli.stdout


def test_a_script_beside_a_store_folder_attaches_and_writes(fresh_env, tmp_path):
    """The user's own `store/` (and `alerts/`) packages beside their script win for their imports,
    and moescope still records into its store."""
    python, env = fresh_env
    for name in ("store", "alerts"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"OWNER = 'the user: {name}'\n")
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import sys
        import torch
        import store, alerts
        import moescope
        sys.path.append(REPO_PATH)  # after moescope: the wheel's moescope, the repository's test models
        from tests.support.zoo import tiny_model

        assert store.OWNER == "the user: store" and alerts.OWNER == "the user: alerts"
        model = tiny_model("mixtral")
        with moescope.attach(model, store="runs", routes=True, window=1):
            model(input_ids=torch.randint(0, 128, (2, 8)))
            model(input_ids=torch.randint(0, 128, (2, 8)))
        print("recorded")
    """).replace("REPO_PATH", repr(REPO)))
    done = subprocess.run([python, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "recorded" in done.stdout

    import pyarrow.parquet as pq

    steps = glob.glob(str(tmp_path / "runs" / "steps" / "**" / "*.parquet"), recursive=True)
    routes = glob.glob(str(tmp_path / "runs" / "routes" / "**" / "*.parquet"), recursive=True)
    assert sum(pq.read_metadata(f).num_rows for f in steps) == 2
    # 2 forwards x 2 MoE layers x 16 tokens
    assert sum(pq.read_metadata(f).num_rows for f in routes) == 2 * 2 * 16
