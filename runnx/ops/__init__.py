"""Operator kernels, one module per op family; importing this package registers them all."""
import importlib
import pkgutil

from runnx.ops import _jit_cache, registry

_jit_cache.drop_stale()  # before any kernel loads from numba's cache
_jit_cache.serialize_saves()  # before any kernel compiles
for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_") and _module.name != "registry":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["registry"]
