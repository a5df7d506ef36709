"""Thread settings: how many threads BLAS (through threadpoolctl), numba and runnx's own one-row
product workers (`runnx/ops/_row_pool.py`: threads - 1 of them) may use.

These pools are per process, so `Options.threads` (RUNNX_THREADS) is applied when a model is
loaded, and the counts in effect are reported in the profile. 0 leaves the libraries' defaults
(OPENBLAS_NUM_THREADS, NUMBA_NUM_THREADS, ... or the core count).
"""
from __future__ import annotations


def apply_threads(count: int) -> None:
    """Limit BLAS, numba and the one-row product workers to `count` threads (0: leave them)."""
    if count > 0:
        import numba
        import threadpoolctl

        from runnx.ops import _row_pool

        threadpoolctl.threadpool_limits(limits=count, user_api="blas")
        numba.set_num_threads(min(count, numba.config.NUMBA_NUM_THREADS))
        _row_pool.set_workers(count - 1)


def thread_counts() -> dict:
    """{'blas': threads (a list when BLAS libraries differ), 'numba': threads, 'rows': threads of
    one-row products (the caller's and the workers')} in effect now."""
    import numba
    import threadpoolctl

    from runnx.ops import _row_pool

    blas = sorted({pool["num_threads"] for pool in threadpoolctl.threadpool_info() if pool["user_api"] == "blas"})
    return {"blas": blas[0] if len(blas) == 1 else blas, "numba": numba.get_num_threads(),
            "rows": 1 + _row_pool.worker_count()}
