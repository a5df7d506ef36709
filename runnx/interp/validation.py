"""Feed validation, before anything runs: names, dtypes (never cast silently), ranks, dimensions."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from runnx.capture.ownership import Owned, read_only_view
from runnx.errors import InputShapeError, InputTypeError, UnknownInputError
from runnx.interp.dtypes import ONNX_TO_NUMPY, type_name
from runnx.interp.ir import Graph, ValueInfo


class FeedSpec:
    """What one model input accepts, precomputed once per model."""

    __slots__ = ("name", "vid", "info", "kind", "dtype", "shape", "fixed", "symbolic", "checked")

    def __init__(self, name: str, vid: int, info: ValueInfo | None):
        self.name, self.vid, self.info = name, vid, info
        self.kind = info.kind if info is not None else "tensor"
        self.dtype = ONNX_TO_NUMPY.get(info.elem_type) if info is not None and info.elem_type else None
        self.shape = info.shape if info is not None and info.kind == "tensor" else None
        dims = tuple(enumerate(self.shape or ()))
        self.fixed = tuple((axis, d) for axis, d in dims if isinstance(d, int) and d > 0)  # (axis, size)
        self.symbolic = tuple((axis, d) for axis, d in dims if isinstance(d, str))  # (axis, name)
        self.checked = None  # the last shape `check_shape` passed without symbols to agree on


def feed_specs(graph: Graph) -> dict[str, FeedSpec]:
    """A spec per input, overridable initializers included (checked against their declared type)."""
    specs = {graph.names[vid]: FeedSpec(graph.names[vid], vid, info)
             for vid, info in zip(graph.inputs, graph.input_info)}
    for vid, info in graph.default_info.items():
        specs[graph.names[vid]] = FeedSpec(graph.names[vid], vid, info)
    return specs


def _as_value(spec: FeedSpec, raw):
    """The array (or sequence / None) runnx will hold for a feed."""
    kind = spec.info.kind if spec.info is not None else "tensor"
    if kind == "optional":
        if raw is None:
            return None
        kind = spec.info.inner_kind
    if kind == "sequence":
        if not isinstance(raw, (list, tuple)):
            raise InputTypeError(f"input '{spec.name}' is a sequence: pass a list of arrays, got {type(raw).__name__}")
        return [_as_array(spec, item) for item in raw]
    return _as_array(spec, raw)


def _as_array(spec: FeedSpec, raw) -> np.ndarray:
    if isinstance(raw, np.ndarray):
        array = raw
    elif isinstance(raw, (np.generic, int, float, bool, str, bytes, list, tuple)):
        array = np.asarray(raw)  # wrapping, not casting: the dtype check below still applies
    else:
        raise InputTypeError(f"input '{spec.name}' must be a numpy array, got {type(raw).__name__}")
    if array.dtype.kind in "US":
        array = array.astype(object)
    expected = spec.dtype
    if expected is not None and array.dtype != expected:
        wanted = type_name(spec.info.elem_type)
        raise InputTypeError(f"input '{spec.name}' expects {wanted} ({expected}), got an array of {array.dtype}"
                             " (runnx does not cast inputs: convert it with .astype)")
    return array


def check_shape(spec: FeedSpec, array: np.ndarray, symbols: dict | None) -> None:
    """Rank, fixed dimensions and, unless symbols is None, one size per symbolic name across inputs."""
    declared = spec.shape
    if declared is None or not isinstance(array, np.ndarray):
        return
    shape = array.shape
    if shape == spec.checked and (symbols is None or not spec.symbolic):  # a decode step's feeds, as before
        return
    if array.ndim != len(declared):
        raise InputShapeError(f"input '{spec.name}' expects rank {len(declared)} (shape {_show(declared)}), "
                              f"got shape {list(array.shape)}")
    for axis, want in spec.fixed:
        if shape[axis] != want:
            raise InputShapeError(f"input '{spec.name}' expects dimension {axis} to be {want} (shape "
                                  f"{_show(declared)}), got shape {list(shape)}")
    for axis, want in spec.symbolic if symbols is not None else ():
        got = shape[axis]
        seen = symbols.setdefault(want, (got, spec.name))
        if seen[0] != got:
            raise InputShapeError(f"input '{spec.name}' has {want}={got} at dimension {axis}, but input "
                                  f"'{seen[1]}' has {want}={seen[0]}")
    spec.checked = shape


def _show(shape) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def bind_feeds(specs: dict[str, FeedSpec], feeds, check_symbolic_dims: bool = True) -> dict[int, tuple]:
    """value id -> (value, owned) for every feed; raises InputError subclasses naming the culprit."""
    if not isinstance(feeds, Mapping):
        raise InputTypeError(f"feeds must be a mapping of input name to array, got {type(feeds).__name__}")
    bound, symbols = {}, ({} if check_symbolic_dims else None)
    for name, raw in feeds.items():
        spec = specs.get(name)
        if spec is None:
            known = ", ".join(sorted(specs)) or "none"
            raise UnknownInputError(f"'{name}' is not an input of the model (inputs: {known})")
        owned = type(raw) is not np.ndarray and isinstance(raw, Owned)
        value = raw.array if owned else raw
        if type(value) is not np.ndarray or value.dtype != spec.dtype or spec.kind != "tensor":
            value = _as_value(spec, value)  # an array of the input's dtype as it is: a decode step's 62
        if isinstance(value, np.ndarray):
            check_shape(spec, value, symbols)
            if not owned or not value.flags.writeable:
                # a view of its own each run, even of a read-only array: what runnx remembers by an
                # array's identity (ops/_remembered.py) is then never found again for the caller's
                # object, whose buffer the caller may change between runs
                value = read_only_view(value)
                owned = False
        elif isinstance(value, list):
            value = [read_only_view(v) for v in value] if not owned else value
        bound[spec.vid] = (value, owned)
    return bound
