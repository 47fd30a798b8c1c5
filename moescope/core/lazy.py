"""Re-exports imported on first use: a package's face without the cost of the modules behind it.

A package whose `__init__.py` re-exports names from heavy modules (DuckDB, Streamlit, torch) would load
them all on `import moescope.probe`. Instead it maps each name to the module that defines it and lets
Python ask on first use (PEP 562, a module's `__getattr__`):

    if TYPE_CHECKING:
        from moescope.store.store import Store
    else:
        __getattr__, __dir__ = lazy_exports(__name__, {"Store": "moescope.store.store", ...})

The first `package.Store` imports `moescope.store.store` and keeps the value in the package's namespace,
so later reads are plain attribute reads. The package still lists the names in `__all__` (a literal, as
griffe and `from package import *` read it) and imports them under `TYPE_CHECKING` for mypy and for the
API reference; the `else` keeps the `__getattr__` out of mypy's sight, so a name the package does not
export is an error there rather than `Any`. Standard library only: every room may use it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's `__getattr__` and `__dir__` for names imported on first use.

    Args:
        package: the package's `__name__`.
        exports: each name -> the module that defines it under that name; a name mapped to
            `package.name` is that submodule itself (a package whose face is its modules).

    Returns:
        (`__getattr__`, `__dir__`): the first imports a name's module on first use, keeps the value in
        the package and returns it, and raises AttributeError for a name `exports` does not hold;
        the second lists the package's names with the ones not imported yet.
    """
    exports = dict(exports)

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        target = importlib.import_module(module)
        value = target if module == f"{package}.{name}" else getattr(target, name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
