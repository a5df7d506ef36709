"""OpenBLAS's thread timeout, set before numpy loads OpenBLAS (imported first by runnx/__init__.py).

OpenBLAS's threads spin for 2**28 cycles (~0.1 s) after each call, on the cores that the decode
pool's worker and runnx's own threads need: a decode step right after a prefill or an encoder ran
2-3x slower. 2**4 cycles: they sleep at once (waking costs microseconds, next to a GEMM's
milliseconds). The variable is read when numpy loads OpenBLAS, so it takes effect when runnx is
imported first (the CLI, the benchmarks); an explicit setting wins.
"""
import os
import sys

_given = os.environ.get("OPENBLAS_THREAD_TIMEOUT")
_loaded = "numpy" in sys.modules  # OpenBLAS has read the variable already
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

# whether OpenBLAS's threads sleep right after a call in this process (when they spin, other
# threads running BLAS alongside them share the cores with them: `blas_split.py`)
THREADS_SLEEP = int(_given) <= 8 if _given and _given.strip().isdigit() else not _loaded
