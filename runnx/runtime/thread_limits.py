"""How many threads BLAS (through threadpoolctl), numba and runnx's decode pool (`pool.py`:
threads - 1 workers) may use: `runtime.set_threads` and `runtime.threads`.

These pools are per process, so `Options.threads` (RUNNX_THREADS) is applied when a model is
loaded, and the counts in effect are reported in the profile. 0 leaves the libraries' defaults
(OPENBLAS_NUM_THREADS, NUMBA_NUM_THREADS, ... or the core count).
"""
from __future__ import annotations


def apply_threads(count: int) -> None:
    """Limit BLAS, numba and the decode pool to `count` threads (0: leave them)."""
    if count > 0:
        import numba
        import threadpoolctl

        from runnx.runtime import pool as decode_pool

        threadpoolctl.threadpool_limits(limits=count, user_api="blas")
        numba.set_num_threads(min(count, numba.config.NUMBA_NUM_THREADS))
        decode_pool.set_workers(count - 1)


def thread_counts() -> dict:
    """{'blas': threads (a list when BLAS libraries differ), 'numba': threads, 'decode': threads of
    the decode pool (the caller's and the workers')} in effect now."""
    import numba
    import threadpoolctl

    from runnx.runtime import pool as decode_pool

    blas = sorted({pool["num_threads"] for pool in threadpoolctl.threadpool_info() if pool["user_api"] == "blas"})
    return {"blas": blas[0] if len(blas) == 1 else blas, "numba": numba.get_num_threads(),
            "decode": 1 + decode_pool.worker_count()}
