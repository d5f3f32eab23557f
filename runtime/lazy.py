"""Package attributes that import their module on first use (PEP 562), so that importing a
package (and building the CLI's parser) does not pull in torch, transformers or ultralytics."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A module-level `__getattr__` serving `exports` (attribute name -> defining module)."""

    def __getattr__(name: str) -> object:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
