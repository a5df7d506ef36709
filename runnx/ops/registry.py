"""The operator registry: the one place that knows which kernel runs which (domain, op, opset).

A kernel is a plain function named after the ONNX op. Arrays are positional (a missing optional
input arrives as None); attributes are keyword-only, typed, with the ONNX defaults in the
signature. Three keyword names are reserved:

- ``overwrite``: the positions of inputs this call may reuse or overwrite (declared with
  ``inplace=``; the executor grants a position only when that input is owned, dead after this
  node and not aliased by any live value),
- ``ctx``: the RunContext (options, profile counters, subgraph execution),
- ``output_count``: how many outputs the node declares (Split into equal parts needs it).

``shape_only=`` declares input positions read only for their shape and dtype (Shape, Size): the
planner lets an earlier node overwrite such an input's data in place.

``ufunc=`` declares a kernel that is exactly `binary` or `unary` of that numpy ufunc
(`_elementwise_util.py`): a compiled plan calls the ufunc inline, into the granted input
`inplace_target` (`binary`'s rule) or `unary` picks, without the two calls around it (half a
tiny node's cost).

``overlaps_jobs=True`` declares a kernel that may return before its outputs are written, when the
run allows it (`runtime/open_jobs.py`): a decode-pool job it posted still computing them
(`open_nbits_rows`, `open_shared_call`), or its native calls deferred (`runtime.defer`); and that
may be called while earlier nodes' jobs or deferred calls are pending: the compiled plan settles
only before the next node that is not declared so. Such a kernel reads its inputs' data only in
native calls that post or defer (a post runs whatever is pending first), or after settling, but
for the positions it declares in ``reads_data=`` (a mask, sequence lengths: read from Python),
before which the plan settles when a pending call may still write them.

``prepack=fn`` declares a kernel that prepares something from its constant inputs on its first
call and keeps it (a 4-bit weight's tiles, in a `Remembered`): fn(inputs, attrs), given the
node's inputs (its constants; None for an input left out, `COMPUTED` for one computed by a run)
and its attributes with their defaults, plans making it ahead (`Model.prepack_in_background`, as
onnxruntime's kernels prepack at session creation): it returns None when there is nothing to
make, else the pending work (a list of them for a kernel with several weights), each with a
`batch` function, which the prepacking thread calls once with every node's pending work of that
function, in the graph's order, and which returns a function making it (called once every kind is planned: a model's 4-bit tiles made in one native call that
needs no GIL, while the thread that started the prepack goes on). It checks what the kernel would
check before making it, and what it raises is dropped: the node's own run raises it.

A kernel returns one value, or a tuple for several outputs (a list is a sequence value). It must
never return a writeable array that it keeps a reference to (module caches must be read-only).
Resolution picks the newest registration whose since-version is <= the model's opset.
"""
from __future__ import annotations

import inspect
import types
import typing
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from runnx.capture.env import Subgraph

REQUIRED = inspect.Parameter.empty
RESERVED = ("overwrite", "ctx", "output_count")
DEFAULT_DOMAIN = ""
COMPUTED = type("Computed", (), {"__repr__": lambda self: "COMPUTED"})()  # a prepack's input that a run computes


@dataclass(frozen=True, slots=True)
class Kernel:
    op_type: str
    domain: str
    since: int
    fn: typing.Callable
    inplace: tuple[int, ...]  # input positions the kernel can reuse
    inplace_from: int | None  # all positions >= this one too (variadic ops like Loop)
    attrs: dict  # name -> (allowed python types, default or REQUIRED)
    subgraph_attrs: tuple[str, ...]
    wants_ctx: bool
    wants_output_count: bool
    arity: tuple[int, int | None] = (0, None)  # (positional inputs without default, max or None: variadic)
    shape_only: tuple[int, ...] = ()  # input positions read only for their shape and dtype, never their data
    ufunc: typing.Any = None  # the numpy ufunc the kernel is `binary`/`unary` of, if it is exactly that
    overlaps_jobs: bool = False  # may return while a pool job still writes its output (`runtime/pool.py`)
    prepack: typing.Callable | None = None  # fn(constant inputs, attributes): what a first call would make
    reads_data: tuple[int, ...] = ()  # input positions an overlaps_jobs kernel reads the data of from Python

    def attributes_of(self, attrs: dict) -> dict:
        """A node's attributes `attrs` with the defaults of those it leaves out (required ones it
        lacks stay missing)."""
        return {name: attrs[name] if name in attrs else default for name, (_, default) in self.attrs.items()
                if name in attrs or default is not REQUIRED}

    def can_overwrite(self, position: int) -> bool:
        return position in self.inplace or (self.inplace_from is not None and position >= self.inplace_from)


_REGISTRY: dict[tuple[str, str], list[Kernel]] = {}


def _canonical_domain(domain: str) -> str:
    return DEFAULT_DOMAIN if domain in ("", "ai.onnx") else domain


def _allowed_types(annotation) -> tuple:
    """Python types an attribute value may have, from the kernel's annotation."""
    if annotation is REQUIRED:
        return (object,)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        allowed = ()
        for arg in typing.get_args(annotation):
            allowed += (type(None),) if arg is type(None) else _allowed_types(arg)
        return allowed
    if origin in (list, tuple) or annotation in (list, tuple):
        return (tuple,)
    if annotation is float:
        return (float, int)
    return (annotation,)


def register(op_type: str, *, since: int, domain: str = DEFAULT_DOMAIN, inplace: tuple[int, ...] = (),
             inplace_from: int | None = None, shape_only: tuple[int, ...] = (), ufunc=None,
             overlaps_jobs: bool = False, prepack=None, reads_data: tuple[int, ...] = ()):
    """Register a kernel for `op_type` from opset `since` on; see the module docstring."""

    def decorate(fn):
        hints = typing.get_type_hints(fn)
        attrs, subgraphs = {}, []
        params = inspect.signature(fn).parameters
        for name, param in params.items():
            if param.kind is not inspect.Parameter.KEYWORD_ONLY or name in RESERVED:
                continue
            annotation = hints.get(name, REQUIRED)
            if annotation is Subgraph or Subgraph in typing.get_args(annotation):  # `Subgraph | None`: optional
                subgraphs.append(name)
            attrs[name] = (_allowed_types(annotation), param.default)
        if (inplace or inplace_from is not None) and "overwrite" not in params:
            raise TypeError(f"kernel {fn.__name__} declares in-place inputs but takes no 'overwrite'")
        positional = [p for p in params.values()
                      if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        variadic = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values())
        arity = (sum(p.default is REQUIRED for p in positional), None if variadic else len(positional))
        kernel = Kernel(op_type, _canonical_domain(domain), since, fn, tuple(inplace), inplace_from, attrs,
                        tuple(subgraphs), "ctx" in params, "output_count" in params, arity, tuple(shape_only), ufunc,
                        overlaps_jobs, prepack, tuple(reads_data))
        versions = _REGISTRY.setdefault((kernel.domain, op_type), [])
        if any(k.since == since for k in versions):
            raise ValueError(f"{op_type} since {since} registered twice")
        versions.append(kernel)
        versions.sort(key=lambda k: k.since)
        return fn

    return decorate


def _load_families() -> None:
    """Every op family registered: they are imported on the first question asked here."""
    from runnx.ops import load_families
    load_families()


def resolve(domain: str, op_type: str, opset: int) -> Kernel | None:
    """The kernel for this op at this opset, or None when runnx has none."""
    _load_families()
    versions = _REGISTRY.get((_canonical_domain(domain), op_type), ())
    chosen = None
    for kernel in versions:
        if kernel.since <= opset:
            chosen = kernel
    return chosen


def known_versions(domain: str, op_type: str) -> list[int]:
    _load_families()
    return [k.since for k in _REGISTRY.get((_canonical_domain(domain), op_type), ())]


def newest_opset(domain: str) -> int | None:
    """The newest opset of `domain` that runnx's kernels know: their newest since-version (each
    change of an op's semantics gets a kernel of its own), or None when runnx has no kernel there."""
    _load_families()  # every family: an op module imported on its own has registered only its kernels
    domain = _canonical_domain(domain)
    return max((k.since for (d, _), kernels in _REGISTRY.items() if d == domain for k in kernels), default=None)


def all_ops() -> list[tuple[str, str, list[int]]]:
    """(domain, op_type, since-versions) of everything registered, for `runnx inspect` and docs."""
    _load_families()
    return sorted((d, op, [k.since for k in ks]) for (d, op), ks in _REGISTRY.items())


def check_attribute(kernel: Kernel, name: str, value) -> str | None:
    """Why `value` is not acceptable for attribute `name` of `kernel`, or None when it is."""
    if name not in kernel.attrs:
        known = ", ".join(sorted(kernel.attrs)) or "none"
        return f"unknown attribute '{name}' (known: {known})"
    allowed, _ = kernel.attrs[name]
    if name in kernel.subgraph_attrs:
        return None if hasattr(value, "nodes") else f"attribute '{name}' should be a graph"
    if object in allowed or isinstance(value, allowed):
        return None
    if isinstance(value, np.ndarray) and np.ndarray in allowed:
        return None
    wanted = " or ".join(sorted({t.__name__ for t in allowed}))
    return f"attribute '{name}' should be {wanted}, got {type(value).__name__}"


def with_attributes(fn, attrs: dict):
    """A copy of kernel `fn` whose keyword-only parameters named in `attrs` default to their values
    there (a node's attributes), to be called without them, or None when `fn` is
    not a plain function taking every one of them as keyword-only: compiled plans and shape memos'
    programs call their kernels so (matching 24 keyword arguments to a fused kernel's parameters
    cost 3.5 us a call, warm)."""
    if type(fn) is not types.FunctionType:
        return None
    code = fn.__code__
    keyword_only = code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount]
    if not all(name in keyword_only for name in attrs):
        return None
    kernel = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    kernel.__kwdefaults__ = {**(fn.__kwdefaults__ or {}), **attrs}
    kernel.__qualname__, kernel.__module__, kernel.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    return kernel


def bound_kernel(fn, attrs: dict) -> tuple:
    """(the kernel to call, the attributes still to pass it): `with_attributes`' copy of `fn` and
    none, or `fn` itself and all of them (generated code then passes them as **keywords)."""
    kernel = with_attributes(fn, attrs) if attrs else None
    return (fn, attrs) if kernel is None else (kernel, {})


@lru_cache(maxsize=4096)
def _unchanged_by_broadcast(shape_a: tuple, shape_b: tuple) -> int:
    """Which of two shapes their broadcast leaves as it is: bit 0 for a, bit 1 for b (0 also when
    they do not broadcast: the ufunc then raises). Cached: a model meets few shape pairs, and
    numpy's broadcast_shapes costs microseconds a call."""
    try:
        shape = np.broadcast_shapes(shape_a, shape_b)
    except ValueError:
        return 0
    return (shape == shape_a) | (shape == shape_b) << 1


def inplace_target(a: np.ndarray, b: np.ndarray, overwrite) -> np.ndarray | None:
    """The granted input (`overwrite`: positions) a ufunc(a, b) may write its result into: a
    (else b) when granted, C-contiguous (the layout copy mode gives: a later reduction's summation
    order follows it) and of the result's shape (broadcasting leaves it as it is) and dtype (both
    inputs of one dtype); None when neither fits."""
    if a.dtype != b.dtype:
        return None
    shape_a, shape_b = a.shape, b.shape
    fits = 3 if shape_a == shape_b else _unchanged_by_broadcast(shape_a, shape_b)
    if fits & 1 and 0 in overwrite and a.flags.c_contiguous:
        return a
    if fits & 2 and 1 in overwrite and b.flags.c_contiguous:
        return b
    return None


def writes_first_inline(a: str, b: str) -> str:
    """Python source, over locals named `a` and `b`, true exactly when `inplace_target` returns a
    granted a for operands of one shape: its common case, for generated code to test without the
    call (`interp/compiled.py`). Kept beside the rule it must agree with."""
    return f"{a}.shape == {b}.shape and {a}.dtype == {b}.dtype and {a}.flags.c_contiguous"


def writable_alone_inline(x: str) -> str:
    """Python source, over a local named `x`, true when a granted x takes a unary ufunc's result
    (`_elementwise_util.unary`'s rule), for generated code."""
    return f"{x}.flags.c_contiguous"
