"""A package's exports loaded on first use (PEP 562).

A package `__init__` that imported every name it offers would load its
whole service for one small module of it: `import edge.fanout` loaded the
runner's runtime and every model provider that way. With `lazy_exports` a
package lists each name with the module that defines it; nothing is
imported until a name is first read, and then only its module. The
package's TYPE_CHECKING block gives mypy and IDEs the same names.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, whose names in `exports`
    (name -> defining module) are imported when first read, then kept."""
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # read once: later reads skip this hook
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *exports])

    return __getattr__, __dir__
