"""The store's face: `moescope.store.__all__` lists what the package exports and nothing else, each
name defined in the store (core's pipeline is imported from core), and the exporter's old name."""

from __future__ import annotations

import importlib
import inspect

import moescope.store as store


def test_every_name_in_all_is_the_stores_own_and_every_lazy_name_is_listed():
    assert sorted(store.__all__) == sorted(store._EXPORTS)
    for name in store.__all__:
        value = getattr(store, name)
        module = inspect.getmodule(value)
        home = module.__name__ if module is not None else store._EXPORTS[name]
        assert home.startswith("moescope.store."), (name, home)
        assert getattr(importlib.import_module(store._EXPORTS[name]), name) is value


def test_cores_pipeline_is_not_the_stores():
    for name in ("BatchProcessor", "InMemoryExporter"):
        assert name not in store.__all__
        assert not hasattr(store, name)


def test_the_exporters_old_name_is_the_delta_exporter_at_both_old_homes():
    from moescope.store import writer
    from moescope.store.exporter import DeltaExporter

    assert store.ParquetExporter is DeltaExporter
    assert writer.ParquetExporter is DeltaExporter
    assert "ParquetExporter" not in writer.__all__
