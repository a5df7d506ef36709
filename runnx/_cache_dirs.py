"""Where runnx keeps what it makes for later processes: one rule for the compiled kernels
(`runnx/ops/_jit_cache.py`), the first-run markers beside them (`runnx/background_compile.py`)
and the bytecode of generated functions (`runnx/interp/codegen.py`).
Imports nothing heavy: a first run reads it before numba loads."""
from __future__ import annotations

import os
from pathlib import Path


def user_cache() -> Path:
    """${RUNNX_CACHE:-~/.cache/runnx} (scripts/build_models.py puts the real models there too)."""
    return Path(os.environ.get("RUNNX_CACHE") or Path.home() / ".cache" / "runnx").expanduser()


def compiled_code_root(numba_cache_dir: str | None) -> Path:
    """`$NUMBA_CACHE_DIR/runnx` when the user set numba's own folder, else `user_cache()/numba`."""
    return Path(numba_cache_dir).expanduser() / "runnx" if numba_cache_dir else user_cache() / "numba"


def generated_code_root() -> Path:
    """`user_cache()/code`: the bytecode of plans and memo groups, one file per source."""
    return user_cache() / "code"
