"""Session options; each has an environment variable so a switch needs no code change."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from runnx.errors import InvalidOptionError

# The optimization levels, least to most, and the switches each one allows (a level allows its
# own and every lower level's). "disabled" is plain interpretation: each node run as the model
# states it, in place where its input dies (`inplace` is the design and result-identical, its own
# switch). Decode replay (ops/_decode_replay.py) lives in the fused kernels: it goes with `fuse`.
LEVELS = ("disabled", "basic", "extended", "all")
_ALLOWED = {
    "disabled": (),
    "basic": ("fold_constants", "shape_cache", "memo_read_ahead"),
    "extended": ("fuse", "compile_after", "specialize_branches"),
    "all": ("last_position",),
}


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def _env_names(name: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in os.environ.get(name, "").split(",") if part.strip())


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


@dataclass(frozen=True)
class Options:
    """inplace: run ops in place / move captures (RUNNX_INPLACE=0 turns it off; results are
    bitwise identical either way). check_inplace: also compute every in-place step out of place and
    compare (RUNNX_CHECK_INPLACE=1). profile: print a profile after each run (RUNNX_PROFILE=1).
    max_tensor_elements / max_loop_iterations: resource limits checked before allocating.
    fold_constants: run nodes whose inputs are all constants once, at load (RUNNX_FOLD_CONSTANTS=0).
    check_symbolic_dims: inputs sharing a symbolic dimension name must agree on its size
    (RUNNX_CHECK_SYMBOLIC_DIMS=1). Off by default, like onnxruntime: Optimum's merged decoders
    name both the input_ids and the attention_mask length 'sequence_length'.
    shape_cache: nodes computing values from tensor shapes only run once per shapes seen
    (RUNNX_SHAPE_CACHE=0 turns it off; results are identical either way). memo_read_ahead: a memo
    missing on shapes grown by a decode step also computes the next steps' (interp/read_ahead.py;
    RUNNX_MEMO_READ_AHEAD=0 turns it off).
    fuse: replace recurring patterns (residual add + RMSNorm, SiLU gate, rotary embedding, attention
    over the KV cache) by fused kernels at load (RUNNX_FUSE=0 turns it off).
    threads: BLAS and numba threads, set for the process at load (RUNNX_THREADS; 0 leaves them).
    compile_after: from its n-th run on, a plan runs compiled to straight-line Python
    (interp/compiled.py; RUNNX_COMPILE_AFTER, default 2; 0 never compiles).
    specialize_branches: a model that is one If on one of its inputs (Optimum's merged decoders)
    runs the branch that input picks as a graph of its own (interp/branches.py;
    RUNNX_SPECIALIZE_BRANCHES=0 runs the If).
    last_position: outputs (an LM head's logits) computed for the last position only
    (interp/last_position.py; RUNNX_LAST_POSITION, comma-separated names; none by default).
    optimization_level: "disabled" / "basic" / "extended" / "all" (RUNNX_OPTIMIZATION_LEVEL, default
    "all"; onnxruntime's GraphOptimizationLevel through SessionOptions). The level caps the
    switches above (`LEVELS`): a switch beyond it is off whatever its own value, and a switch set
    off stays off at any level; `effective()` is the options a model runs with.
    allow_newer_opset: load a model importing a domain at a version newer than runnx's kernels
    know (runs the newest kernels; RUNNX_ALLOW_NEWER_OPSET=1). Refused by default."""

    fold_constants: bool = field(default_factory=lambda: _env_flag("RUNNX_FOLD_CONSTANTS", True))
    inplace: bool = field(default_factory=lambda: _env_flag("RUNNX_INPLACE", True))
    check_inplace: bool = field(default_factory=lambda: _env_flag("RUNNX_CHECK_INPLACE", False))
    profile: bool = field(default_factory=lambda: _env_flag("RUNNX_PROFILE", False))
    trace: bool = field(default_factory=lambda: _env_flag("RUNNX_TRACE", False))
    max_tensor_elements: int = field(default_factory=lambda: _env_int("RUNNX_MAX_TENSOR_ELEMENTS", 2**32))
    max_loop_iterations: int = field(default_factory=lambda: _env_int("RUNNX_MAX_LOOP_ITERATIONS", 10**7))
    check_symbolic_dims: bool = field(default_factory=lambda: _env_flag("RUNNX_CHECK_SYMBOLIC_DIMS", False))
    shape_cache: bool = field(default_factory=lambda: _env_flag("RUNNX_SHAPE_CACHE", True))
    memo_read_ahead: bool = field(default_factory=lambda: _env_flag("RUNNX_MEMO_READ_AHEAD", True))
    fuse: bool = field(default_factory=lambda: _env_flag("RUNNX_FUSE", True))
    threads: int = field(default_factory=lambda: _env_int("RUNNX_THREADS", 0))
    compile_after: int = field(default_factory=lambda: _env_int("RUNNX_COMPILE_AFTER", 2))
    specialize_branches: bool = field(default_factory=lambda: _env_flag("RUNNX_SPECIALIZE_BRANCHES", True))
    last_position: tuple[str, ...] = field(default_factory=lambda: _env_names("RUNNX_LAST_POSITION"))
    optimization_level: str = field(default_factory=lambda: os.environ.get("RUNNX_OPTIMIZATION_LEVEL") or "all")
    allow_newer_opset: bool = field(default_factory=lambda: _env_flag("RUNNX_ALLOW_NEWER_OPSET", False))

    def __post_init__(self):
        if self.optimization_level not in LEVELS:
            raise InvalidOptionError(f"optimization_level {self.optimization_level!r} is not one of "
                                     f"{', '.join(LEVELS)} (Options.optimization_level / RUNNX_OPTIMIZATION_LEVEL)")

    def effective(self) -> "Options":
        """These options with every switch beyond the level turned off (the level itself kept)."""
        beyond = LEVELS[LEVELS.index(self.optimization_level) + 1:]
        off = {name: _OFF[name] for level in beyond for name in _ALLOWED[level]}
        return replace(self, **off) if off else self


_OFF = {"fold_constants": False, "shape_cache": False, "memo_read_ahead": False, "fuse": False, "compile_after": 0,
        "specialize_branches": False, "last_position": ()}
