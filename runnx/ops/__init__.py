"""Operator kernels, one module per op family; each registers its kernels when imported.

`load_families` imports every family module found in this folder (a new one registers without a
list to edit). The registry calls it the first time it is asked for a kernel, so `import runnx`
loads neither the families nor numba: a model load does.
"""
import importlib
import pkgutil
import threading

_lock = threading.RLock()
_loaded = False


def load_families() -> None:
    """Import every op family module (once; later calls return at once)."""
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        from runnx.ops import _jit_cache  # noqa: F401  (numba's cache folder and locks, before any kernel)
        for module in pkgutil.iter_modules(__path__):
            if not module.name.startswith("_") and module.name != "registry":
                importlib.import_module(f"{__name__}.{module.name}")
        _loaded = True


__all__ = ["load_families", "registry"]
