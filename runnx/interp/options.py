"""Session options. One knob picks the optimizations (the level, also RUNNX_OPTIMIZATION_LEVEL);
the safety, debugging, limit and thread options each have an environment variable too."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, replace

from runnx.errors import InvalidOptionError

# The optimization levels, least to most, and the switches each one allows (a level allows its
# own and every lower level's). "disabled" is plain interpretation: each node run as the model
# states it, in place where its input dies (`inplace` is the design and result-identical, its own
# switch).
LEVELS = ("disabled", "basic", "extended", "all")
_ALLOWED = {
    "disabled": (),
    "basic": ("fold_constants", "shape_cache", "memo_read_ahead", "arena"),
    "extended": ("fuse", "compile_after", "specialize_branches", "overlap_jobs"),
    "all": ("last_position",),
}

# Every RUNNX_* variable runnx or its test suite reads. Documented (README's Options): the ones
# Options reads, then the `runnx` command's, the cache folder's, the allocator's and the server's.
# Then the background compile's own (set for the process it starts) and the test suite's.
DOCUMENTED = (
    "RUNNX_OPTIMIZATION_LEVEL", "RUNNX_THREADS", "RUNNX_CHECK_INPLACE", "RUNNX_PROFILE", "RUNNX_TRACE",
    "RUNNX_MAX_TENSOR_ELEMENTS", "RUNNX_MAX_LOOP_ITERATIONS", "RUNNX_CHECK_SYMBOLIC_DIMS", "RUNNX_ALLOW_NEWER_OPSET",
    "RUNNX_CACHE", "RUNNX_COMPILE", "RUNNX_KEEP_FREED", "RUNNX_API_KEY",
)
ENVIRONMENT = DOCUMENTED + ("RUNNX_COMPILE_MARKER", "RUNNX_FIXTURES", "RUNNX_BACKEND_INCLUDE")
# Switches of result-identical optimizations that are Options fields only: the level is their
# environment knob. A variable here is ignored with a warning saying what replaces it.
_BASIC = "RUNNX_OPTIMIZATION_LEVEL=disabled turns off the 'basic' optimizations"
_EXTENDED = "RUNNX_OPTIMIZATION_LEVEL=basic turns off the 'extended' optimizations"
REMOVED = {
    "RUNNX_FOLD_CONSTANTS": f"{_BASIC}; runnx.load(..., fold_constants=False) this one alone",
    "RUNNX_SHAPE_CACHE": f"{_BASIC}; runnx.load(..., shape_cache=False) this one alone",
    "RUNNX_MEMO_READ_AHEAD": f"{_BASIC}; runnx.load(..., memo_read_ahead=False) this one alone",
    "RUNNX_ARENA": f"{_BASIC}; runnx.load(..., arena=False) this one alone",
    "RUNNX_FUSE": f"{_EXTENDED}; runnx.load(..., fuse=False) this one alone",
    "RUNNX_COMPILE_AFTER": f"{_EXTENDED}; runnx.load(..., compile_after=N) this one alone",
    "RUNNX_SPECIALIZE_BRANCHES": f"{_EXTENDED}; runnx.load(..., specialize_branches=False) this one alone",
    "RUNNX_OVERLAP_JOBS": f"{_EXTENDED}; runnx.load(..., overlap_jobs=False) this one alone",
    "RUNNX_LAST_POSITION": "runnx.load(..., last_position=('logits',)) names the outputs (the generation API "
                           "sets it); RUNNX_OPTIMIZATION_LEVEL=extended turns it off",
    "RUNNX_INPLACE": "runnx.load(..., inplace=False) runs out of place; RUNNX_CHECK_INPLACE=1 checks every "
                     "in-place step against it",
}
_warned: set[str] = set()


def warn_unknown_environment(environ=os.environ) -> None:
    """Warn once per process for each RUNNX_* variable set that runnx does not read: a removed
    switch (naming what replaces it) or a misspelling would otherwise change nothing silently."""
    for name in sorted(environ):
        if not name.startswith("RUNNX_") or name in ENVIRONMENT or name in _warned:
            continue
        _warned.add(name)
        why = REMOVED.get(name) or f"not a runnx variable; the README's Options lists them ({', '.join(DOCUMENTED)})"
        warnings.warn(f"runnx ignores {name}: {why}", UserWarning, stacklevel=4)  # at the caller of Options()


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


@dataclass(frozen=True)
class Options:
    """How a model loads and runs; `runnx.load(path, name=value)` sets any field.

    optimization_level: "disabled" / "basic" / "extended" / "all" (RUNNX_OPTIMIZATION_LEVEL, default
    "all"; onnxruntime's GraphOptimizationLevel through SessionOptions). The one knob of the
    optimizations: the level caps the switches below (`LEVELS`), a switch beyond it is off whatever
    its own value, a switch set off stays off at any level; `effective()` is the options a model
    runs with.

    Result-identical switches, fields only (for tests comparing a pass on and off, and for A/B
    benchmarks): fold_constants runs nodes whose inputs are all constants once, at load.
    shape_cache: nodes computing values from tensor shapes only run once per shapes seen.
    memo_read_ahead: a memo missing on shapes grown by a decode step also computes the next steps'
    (interp/read_ahead.py). arena: a run's large numpy arrays, once freed, kept for its next arrays
    of their size instead of going back to the system (runtime/arena.py). fuse: recurring patterns
    (residual add + norm, gated MLP, rotary embedding, attention over the KV cache) become fused
    kernels at load. compile_after: from its
    n-th run on, a plan runs compiled to straight-line Python (interp/compiled.py; 0 never).
    specialize_branches: a model that is one If on one of its inputs (Optimum's merged decoders)
    runs the branch that input picks as a graph of its own (interp/branches.py). overlap_jobs: a
    compiled plan's decode kernels return before their outputs are written, their products left
    computing on the decode pool's workers or their native calls deferred, the plan going on to the
    next node until one reads what they write (runtime/open_jobs.py; bitwise identical off).
    inplace: run ops in place and move captures (bitwise identical off).
    last_position: outputs (an LM head's logits) computed for the last position only, by name
    (interp/last_position.py; the generation API loads decoders with ("logits",)).

    Safety, debugging, limits and threads, each with its environment variable:
    check_inplace: also compute every in-place step out of place and compare (RUNNX_CHECK_INPLACE=1).
    profile: print a profile after each run (RUNNX_PROFILE=1). trace: print each node as it runs
    (RUNNX_TRACE=1). max_tensor_elements / max_loop_iterations: resource limits checked before
    allocating (RUNNX_MAX_TENSOR_ELEMENTS, RUNNX_MAX_LOOP_ITERATIONS). check_symbolic_dims: inputs
    sharing a symbolic dimension name must agree on its size (RUNNX_CHECK_SYMBOLIC_DIMS=1); off by
    default, like onnxruntime: Optimum's merged decoders name both the input_ids and the
    attention_mask length 'sequence_length'. allow_newer_opset: load a model importing a domain at
    a version newer than runnx's kernels know, running the newest kernels
    (RUNNX_ALLOW_NEWER_OPSET=1; refused by default). threads: BLAS, numba and decode-pool threads,
    set for the process at load (RUNNX_THREADS; 0 leaves them; `runnx.set_threads` sets them now).

    Building Options warns once per process about any other RUNNX_* variable set
    (`warn_unknown_environment`)."""

    optimization_level: str = field(default_factory=lambda: os.environ.get("RUNNX_OPTIMIZATION_LEVEL") or "all")
    fold_constants: bool = True
    shape_cache: bool = True
    memo_read_ahead: bool = True
    arena: bool = True
    fuse: bool = True
    compile_after: int = 2
    specialize_branches: bool = True
    overlap_jobs: bool = True
    inplace: bool = True
    last_position: tuple[str, ...] = ()
    check_inplace: bool = field(default_factory=lambda: _env_flag("RUNNX_CHECK_INPLACE", False))
    profile: bool = field(default_factory=lambda: _env_flag("RUNNX_PROFILE", False))
    trace: bool = field(default_factory=lambda: _env_flag("RUNNX_TRACE", False))
    max_tensor_elements: int = field(default_factory=lambda: _env_int("RUNNX_MAX_TENSOR_ELEMENTS", 2**32))
    max_loop_iterations: int = field(default_factory=lambda: _env_int("RUNNX_MAX_LOOP_ITERATIONS", 10**7))
    check_symbolic_dims: bool = field(default_factory=lambda: _env_flag("RUNNX_CHECK_SYMBOLIC_DIMS", False))
    allow_newer_opset: bool = field(default_factory=lambda: _env_flag("RUNNX_ALLOW_NEWER_OPSET", False))
    threads: int = field(default_factory=lambda: _env_int("RUNNX_THREADS", 0))

    def __post_init__(self):
        if self.optimization_level not in LEVELS:
            raise InvalidOptionError(f"optimization_level {self.optimization_level!r} is not one of "
                                     f"{', '.join(LEVELS)} (Options.optimization_level / RUNNX_OPTIMIZATION_LEVEL)")
        warn_unknown_environment()

    def effective(self) -> "Options":
        """These options with every switch beyond the level turned off (the level itself kept)."""
        beyond = LEVELS[LEVELS.index(self.optimization_level) + 1:]
        off = {name: _OFF[name] for level in beyond for name in _ALLOWED[level]}
        return replace(self, **off) if off else self


_OFF = {"fold_constants": False, "shape_cache": False, "memo_read_ahead": False, "arena": False, "fuse": False,
        "compile_after": 0, "specialize_branches": False, "overlap_jobs": False, "last_position": ()}
