"""Operator kernels, one module per op family; importing this package registers them all."""
import importlib
import pkgutil

from runnx.ops import registry

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_") and _module.name != "registry":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["registry"]
