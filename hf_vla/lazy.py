"""Names a package or command exposes but loads on first use, so that importing it (and `--help`) costs no torch."""

from __future__ import annotations

import importlib


def lazy_attributes(module: str, public: dict[str, str]):
    """A module-level `__getattr__` for `module` serving each name of `public` (name -> the module defining it,
    absolute or relative to `module`) from its defining module, imported when first asked for.

        __getattr__ = lazy_attributes(__name__, {"PI05Config": ".configuration_pi05"})
    """

    def __getattr__(name: str):
        if name in public:
            return getattr(importlib.import_module(public[name], module), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
