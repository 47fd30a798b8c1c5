"""The lazy re-exports (`moescope.core.lazy`): a package's names import their module on first use only."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from moescope.core.lazy import lazy_exports


@pytest.fixture
def package(tmp_path, monkeypatch):
    (tmp_path / "lazy_defining_module.py").write_text("VALUE = object()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    face = types.ModuleType("lazy_face")
    face.__getattr__, face.__dir__ = lazy_exports("lazy_face", {"VALUE": "lazy_defining_module"})
    monkeypatch.setitem(sys.modules, "lazy_face", face)
    yield face
    sys.modules.pop("lazy_defining_module", None)


def test_a_name_imports_its_module_on_first_use_and_stays(package):
    assert "lazy_defining_module" not in sys.modules
    assert "VALUE" in dir(package)
    value = package.VALUE
    assert value is sys.modules["lazy_defining_module"].VALUE
    assert vars(package)["VALUE"] is value  # kept: the next read is a plain attribute read


def test_a_name_the_package_does_not_export_is_an_attribute_error(package):
    with pytest.raises(AttributeError, match="module 'lazy_face' has no attribute 'OTHER'"):
        package.OTHER
    assert "lazy_defining_module" not in sys.modules


@pytest.mark.parametrize("face, name, heavy", [
    ("moescope", "Store", "duckdb"),
    ("moescope.alerts", "AlertEngine", "moescope.alerts.engine"),
    ("moescope.prometheus", "PrometheusExporter", "prometheus_client"),
    ("moescope.core", "StepRecord", "numpy"),
])
def test_importing_a_face_loads_none_of_the_modules_behind_it(face, name, heavy):
    code = (f"import sys, {face} as face\n"
            f"assert {heavy!r} not in sys.modules, 'loaded on import'\n"
            f"face.{name}\n"
            f"assert {heavy!r} in sys.modules, 'not loaded on use'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
