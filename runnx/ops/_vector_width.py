"""`full_width()`: the loops of the numba function calling it vectorise at the CPU's full vector
width.

LLVM tunes code for Intel's AVX-512 CPUs to prefer 256-bit vectors in the loops it vectorises
itself (`prefer-256-bit`: 512-bit instructions slowed the clock of the first such CPUs), so
numba's elementwise loops ran 8 floats at a time where the CPU takes 16. runnx's own products
write their 512-bit arithmetic out (`_kernels_gemm.py`); a row kernel that runs from cache (a
prompt's softmax, the erf GELU, norms) asks for the full width with this call, which sets the
function's `prefer-vector-width` to 512 bits: a CPU with narrower vectors takes its own. The
width decides how many elements a vector instruction computes, not how each element is computed:
an elementwise loop gives the same bits at any width, and so does a reduction LLVM may not
reorder (no `reassoc` flag). A loop reordering a sum under `reassoc` sums in another order at
another width: those kernels keep their width.
"""
from __future__ import annotations

import llvmlite.binding as llvm
import numba
from numba.core import types
from numba.extending import intrinsic

_ATTRIBUTE = '"prefer-vector-width"="512"'


@intrinsic
def full_width(typingctx):
    """Ask for 512-bit vectors in the calling function's loops (nothing computed)."""
    def codegen(context, builder, signature, args):
        set.add(builder.function.attributes, _ATTRIBUTE)  # (a string attribute: llvmlite's `add` knows only named ones)
        return context.get_dummy_value()

    return types.void(), codegen


def compiles_for(*features: str) -> bool:
    """Whether numba compiles for a CPU with all these features (LLVM's names: "avx512f", "fma"):
    this machine's (numba's default), or the CPU and features the user named (NUMBA_CPU_NAME,
    NUMBA_CPU_FEATURES: a portable cache's generic target has none of them). Kernels that write a
    feature's instructions or registers out ask first."""
    if numba.config.CPU_NAME is None and numba.config.CPU_FEATURES is None:
        host = llvm.get_host_cpu_features()
        return all(host.get(name, False) for name in features)
    named = (numba.config.CPU_FEATURES or "").split(",")
    return all(f"+{name}" in named for name in features)
