"""The process's machinery under the interpreter: threads (BLAS's, numba's and the decode pool's
workers), the decode pool itself, glibc's malloc thresholds and OpenBLAS's spin timeout.

These settings belong to the process, not to a model, so they live apart from `interp` (which
applies a model's options to them) and from `ops` (whose kernels post jobs to the pool). This
package's `__init__` imports nothing: `import runnx` imports `runtime.openblas` before numpy.
"""
