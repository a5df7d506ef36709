"""Write a benchmark's section into docs/benchmarks.md between its own markers, so that several
scripts can each keep their part of the page current."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGE = DOCS / "benchmarks.md"
HEADER = "# Benchmarks\n\nEach section is written by the script it names; rerun the command to refresh it.\n"
# runnx's loads in the benchmarks (this process and the runners it starts) keep a run's freed
# temporaries mapped, as the `runnx` command does (onnxruntime keeps its own arenas), unless the
# environment says otherwise (runnx/runtime/allocator.py)
os.environ.setdefault("RUNNX_KEEP_FREED", "1")
# and OpenBLAS's threads sleep after each call whatever threads run when a model loads: OpenBLAS
# reads this when numpy loads it, so the scripts import this module before numpy (runnx/runtime/openblas.py)
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def set_threads(count: int) -> None:
    """BLAS, OpenMP and numba thread counts for this process: call it before numpy loads its BLAS."""
    for variable in THREAD_VARIABLES:
        os.environ[variable] = str(count)


def machine() -> str:
    """One line describing the machine and the thread settings."""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown CPU"
    parts = [cpu, f"{os.cpu_count()} cores", f"Python {platform.python_version()}"]
    parts += [f"{k}={os.environ[k]}" for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "NUMBA_NUM_THREADS",
                                               "OPENBLAS_CORETYPE") if os.environ.get(k)]
    return ", ".join(parts + _openblas_kernels())


def _openblas_kernels() -> list[str]:
    """OpenBLAS's kernel family as loaded here (it picks AVX2 'Haswell' or AVX-512 'SkylakeX' ones by
    CPU or by OPENBLAS_CORETYPE), and whether runnx's float32 products run on its own kernels instead
    (`runnx/ops/_matmul.py`: where OpenBLAS's are narrower than the CPU)."""
    import numpy  # noqa: F401  (loads OpenBLAS, so that threadpoolctl finds it)
    import threadpoolctl

    kernels = sorted({pool.get("architecture") or "?" for pool in threadpoolctl.threadpool_info()
                      if pool.get("internal_api") == "openblas"})
    try:
        from runnx.ops._matmul import own_kernels
        own = ["runnx's own AVX-512 float32 products"] if own_kernels() else []
    except ImportError:  # a script run without runnx on its path
        own = []
    return ([f"OpenBLAS {'/'.join(kernels)} kernels"] if kernels else []) + own


def huge_pages_mb() -> int:
    """This process's anonymous memory in huge pages (AnonHugePages), MiB: after runnx's load, how much
    of its weights got them (on a guest whose host backs huge pages slowly, a load keeps what does not
    come fast in 4 KiB pages, and a one-row product streams 13-26% slower there)."""
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            return next((int(line.split()[1]) // 1024 for line in rollup if line.startswith("AnonHugePages:")), 0)
    except OSError:
        return 0


def git_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=DOCS.parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def update_section(key: str, markdown: str) -> Path:
    """Replace (or append) the section delimited by <!-- key --> markers in docs/benchmarks.md."""
    DOCS.mkdir(exist_ok=True)
    page = PAGE.read_text() if PAGE.exists() else HEADER
    start, end = f"<!-- {key} -->", f"<!-- /{key} -->"
    block = f"{start}\n{markdown.strip()}\n{end}"
    if start in page and end in page:
        before, rest = page.split(start, 1)
        page = before + block + rest.split(end, 1)[1]
    else:
        page = page.rstrip() + "\n\n" + block + "\n"
    PAGE.write_text(page)
    return PAGE
