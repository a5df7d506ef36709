"""Shape and layout: Reshape, Squeeze, Transpose, Slice, Split, Pad, Expand, Tile, BitCast, ...

Everything numpy can express as a view returns a view (Reshape, Flatten, Squeeze, Unsqueeze,
Transpose, Slice, Split, BitCast): the executor tracks the shared storage. Broadcast views (Expand, Tile)
are materialised instead, since a zero-stride array must never be handed on as an owned buffer
that a later in-place op could write into. Ops whose output size comes from a tensor's values
(Expand, Tile, Pad, CenterCropPad, Col2Im) check it against the session's element limit first.
"""
from __future__ import annotations

import functools
import itertools
import math

import numpy as np
from onnx import TensorProto

from runnx.errors import RunnxError
from runnx.interp.dtypes import numpy_dtype
from runnx.ops._shape_util import broadcast_shape, int_tuple, int_values, normalize_axes, normalize_axis, split_parts
from runnx.ops.registry import register


@register("Identity", since=1)
def Identity(x):
    return x  # tensors, sequences and optionals alike


@register("Shape", since=1, shape_only=(0,))
def Shape_1(x):
    return np.array(x.shape, dtype=np.int64)


@register("Shape", since=15, shape_only=(0,))
def Shape(x, *, start: int = 0, end: int | None = None):
    return np.array(x.shape[start:end], dtype=np.int64)  # Python slicing clamps exactly as ONNX asks


@register("Size", since=1, shape_only=(0,))
def Size(x):
    return np.array(x.size, dtype=np.int64)


def _reshape(data, shape, allowzero: int):
    target = reshape_target(data.shape, int_tuple(shape), allowzero)
    try:
        return data.reshape(target)
    except ValueError:
        raise RunnxError(f"cannot reshape {data.shape} to {list(target)}") from None


@functools.lru_cache(maxsize=1024)
def reshape_target(shape: tuple, target: tuple, allowzero: int) -> tuple:
    """What numpy reshapes an array of `shape` to for Reshape's `target` (unless allowzero, a 0
    copies the input's dimension), remembered: a decode step reshapes the same shapes to the same
    targets (kept memo results) step after step, and resolving them cost ~2 us a Reshape."""
    if not allowzero and 0 in target:
        if len(target) > len(shape) and 0 in target[len(shape):]:
            raise RunnxError(f"Reshape target {list(target)} copies a dimension the rank-{len(shape)} input lacks")
        target = tuple([shape[i] if d == 0 else d for i, d in enumerate(target)])
    if target.count(-1) > 1:
        raise RunnxError(f"Reshape target {list(target)} has more than one -1")
    return target


@register("Reshape", since=1)
def Reshape_1(data, *, shape: tuple[int, ...] = (), consumed_inputs: tuple[int, ...] | None = None):
    return _reshape(data, shape, 0)


@register("Reshape", since=5)
def Reshape_5(data, shape):
    return _reshape(data, shape, 0)


@register("Reshape", since=14)
def Reshape(data, shape, *, allowzero: int = 0):
    return _reshape(data, shape, allowzero)


@register("Flatten", since=1)
def Flatten(data, *, axis: int = 1):
    if not -data.ndim <= axis <= data.ndim:
        raise RunnxError(f"Flatten axis {axis} is out of range for rank {data.ndim}")
    axis = axis + data.ndim if axis < 0 else axis
    return data.reshape(math.prod(data.shape[:axis]), math.prod(data.shape[axis:]))


def _squeeze(data, axes):
    if not axes:  # absent or empty (as exporters write it): every axis of size 1
        return np.squeeze(data)
    axes = normalize_axes(axes, data.ndim)
    if any(data.shape[a] != 1 for a in axes):
        raise RunnxError(f"Squeeze axes {axes} of shape {data.shape} are not all of size 1")
    return np.squeeze(data, axis=tuple(axes))


@register("Squeeze", since=1)
def Squeeze_1(data, *, axes: tuple[int, ...] | None = None):
    return _squeeze(data, axes)


@register("Squeeze", since=13)
def Squeeze(data, axes=None):
    return _squeeze(data, int_values(axes))


def _unsqueeze(data, axes):
    if len(axes) == 1:  # the common case (shape bookkeeping), without sorting and duplicate checks
        axis = normalize_axis(axes[0], data.ndim + 1, "axes")
        return data.reshape(data.shape[:axis] + (1,) + data.shape[axis:])
    rank = data.ndim + len(axes)
    shape = list(data.shape)
    for axis in sorted(normalize_axes(axes, rank)):  # axes index the output
        shape.insert(axis, 1)
    return data.reshape(shape)


@register("Unsqueeze", since=1)
def Unsqueeze_1(data, *, axes: tuple[int, ...]):
    return _unsqueeze(data, axes)


@register("Unsqueeze", since=13)
def Unsqueeze(data, axes):
    return _unsqueeze(data, int_tuple(axes))


@register("Transpose", since=1)
def Transpose(data, *, perm: tuple[int, ...] | None = None):
    if perm is not None and sorted(perm) != list(range(data.ndim)):
        raise RunnxError(f"Transpose perm {list(perm)} is not a permutation of {data.ndim} axes")
    return data.transpose(perm)  # the method: np.transpose's Python wrapper costs more than the view


@register("Expand", since=8)
def Expand(data, shape, *, ctx):
    out_shape = broadcast_shape(data.shape, int_tuple(shape))
    if out_shape == data.shape:
        return data
    ctx.check_elements(out_shape, "Expand output")
    out = np.empty(out_shape, data.dtype)
    out[...] = data  # the broadcast copy in one call: np.broadcast_to's Python costs 4x the copy of a mask
    return out


def _tile(data, repeats, ctx):
    if len(repeats) != data.ndim or any(r < 0 for r in repeats):
        raise RunnxError(f"Tile repeats {repeats} do not fit an input of rank {data.ndim}")
    ctx.check_elements([d * r for d, r in zip(data.shape, repeats)], "Tile output")
    return np.tile(data, repeats)


@register("Tile", since=1)
def Tile_1(data, tiles, axis, *, ctx):
    repeats = [1] * data.ndim
    repeats[normalize_axis(int(axis), data.ndim)] = int(tiles)
    return _tile(data, repeats, ctx)


@register("Tile", since=6)
def Tile(data, repeats, *, ctx):
    return _tile(data, int_values(repeats), ctx)


@register("Split", since=1)
def Split_1(data, split_input=None, *, axis: int = 0, split: tuple[int, ...] | None = None, output_count):
    sizes = int_values(split_input) if split_input is not None else split
    return split_parts(data, axis, sizes, output_count)


@register("Split", since=2)
def Split_2(data, *, axis: int = 0, split: tuple[int, ...] | None = None, output_count):
    return split_parts(data, axis, split, output_count)


@register("Split", since=13)
def Split_13(data, split=None, *, axis: int = 0, output_count):
    return split_parts(data, axis, int_values(split) or None, output_count)  # empty: equal parts


@register("Split", since=18)
def Split(data, split=None, *, axis: int = 0, num_outputs: int | None = None, output_count):
    sizes = int_values(split) or None  # an empty split input counts as absent
    if sizes is not None and num_outputs is not None:
        raise RunnxError("Split takes either the 'split' input or the 'num_outputs' attribute, not both")
    return split_parts(data, axis, sizes, num_outputs if num_outputs is not None else output_count)


def _bounded_slice(start: int, end: int, step: int, dim: int) -> slice:
    """The Python slice ONNX means: negative positions count from the end, then clamp to the
    dimension ([0, dim] forwards; [0, dim-1] for the start and [-1, dim-1] for the end backwards)."""
    if step == 0:
        raise RunnxError("Slice step cannot be 0")
    start = start + dim if start < 0 else start
    end = end + dim if end < 0 else end
    if step > 0:
        return slice(min(max(start, 0), dim), min(max(end, 0), dim), step)
    start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return slice(start, None if end < 0 else end, step)  # -1 means "past the first element"


def _slice(data, starts, ends, axes, steps):
    if axes is None:
        axes = range(len(starts))
    if steps is None:
        steps = [1] * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise RunnxError(f"Slice starts/ends/axes/steps differ in length: {len(starts)}, {len(ends)}, "
                         f"{len(axes)}, {len(steps)}")
    index = [slice(None)] * data.ndim
    for axis, start, end, step in zip(normalize_axes(axes, data.ndim), starts, ends, steps):
        index[axis] = _bounded_slice(start, end, step, data.shape[axis])
    return data[tuple(index)]


@register("Slice", since=1)
def Slice_1(data, *, starts: tuple[int, ...], ends: tuple[int, ...], axes: tuple[int, ...] | None = None):
    return _slice(data, starts, ends, axes, None)


@register("Slice", since=10)
def Slice(data, starts, ends, axes=None, steps=None):
    return _slice(data, int_values(starts), int_values(ends), int_values(axes), int_values(steps))


_PAD_MODES = ("constant", "reflect", "edge", "wrap")  # numpy.pad has the same names


def _pad(data, pads, mode: str, value, axes, ctx):
    """Pads as [begin of each axis..., end of each axis...]; negative amounts crop."""
    axes = range(data.ndim) if axes is None else normalize_axes(axes, data.ndim)
    if len(pads) != 2 * len(axes):
        raise RunnxError(f"Pad needs 2 amounts per padded axis ({len(axes)} axes), got {len(pads)}")
    if mode not in _PAD_MODES:
        raise RunnxError(f"Pad mode '{mode}' is not one of {', '.join(_PAD_MODES)}")
    widths = [(0, 0)] * data.ndim
    for i, axis in enumerate(axes):
        widths[axis] = (pads[i], pads[i + len(axes)])
    crop = tuple(slice(max(-before, 0), dim - max(-after, 0)) for dim, (before, after) in zip(data.shape, widths))
    data = data[crop]
    widths = [(max(before, 0), max(after, 0)) for before, after in widths]
    ctx.check_elements([d + b + a for d, (b, a) in zip(data.shape, widths)], "Pad output")
    if not any(b or a for b, a in widths):
        return data
    if mode == "constant":
        return np.pad(data, widths, mode="constant", constant_values=value)
    if mode != "edge" and any(d == 0 and (b or a) for d, (b, a) in zip(data.shape, widths)):
        raise RunnxError(f"Pad mode '{mode}' cannot pad an empty axis of shape {data.shape}")
    return np.pad(data, widths, mode=mode)


@register("Pad", since=1)
def Pad_1(data, *, paddings: tuple[int, ...], mode: str = "constant", value: float = 0.0, ctx):
    return _pad(data, paddings, mode, value, None, ctx)


@register("Pad", since=2)
def Pad_2(data, *, pads: tuple[int, ...], mode: str = "constant", value: float = 0.0, ctx):
    return _pad(data, pads, mode, value, None, ctx)


@register("Pad", since=11)
def Pad(data, pads, constant_value=None, axes=None, *, mode: str = "constant", ctx):
    value = 0 if constant_value is None or constant_value.size == 0 else constant_value.reshape(-1)[0]
    return _pad(data, int_values(pads), mode, value, int_values(axes), ctx)


def _blocks(data, blocksize: int, op: str) -> tuple[int, int, int, int]:
    if data.ndim != 4 or blocksize < 1:
        raise RunnxError(f"{op} needs a 4-D input and a positive blocksize, got {data.shape} and {blocksize}")
    return data.shape


def _space_to_depth(data, blocksize: int, mode: str):
    n, c, h, w = _blocks(data, blocksize, "SpaceToDepth")
    if h % blocksize or w % blocksize:
        raise RunnxError(f"SpaceToDepth blocksize {blocksize} does not divide {h}x{w}")
    blocked = data.reshape(n, c, h // blocksize, blocksize, w // blocksize, blocksize)
    # DCR puts the block offsets before the channel, CRD after it
    order = (0, 3, 5, 1, 2, 4) if mode == "DCR" else (0, 1, 3, 5, 2, 4) if mode == "CRD" else None
    if order is None:
        raise RunnxError(f"SpaceToDepth mode '{mode}' is not DCR or CRD")
    return blocked.transpose(order).reshape(n, c * blocksize * blocksize, h // blocksize, w // blocksize)


@register("SpaceToDepth", since=1)
def SpaceToDepth_1(data, *, blocksize: int):
    return _space_to_depth(data, blocksize, "DCR")


@register("SpaceToDepth", since=28)
def SpaceToDepth(data, *, blocksize: int, mode: str = "DCR"):
    return _space_to_depth(data, blocksize, mode)


def _depth_to_space(data, blocksize: int, mode: str):
    n, c, h, w = _blocks(data, blocksize, "DepthToSpace")
    depth = c // (blocksize * blocksize)
    if depth * blocksize * blocksize != c:
        raise RunnxError(f"DepthToSpace blocksize {blocksize} squared does not divide {c} channels")
    if mode == "DCR":
        blocked = data.reshape(n, blocksize, blocksize, depth, h, w).transpose(0, 3, 4, 1, 5, 2)
    elif mode == "CRD":
        blocked = data.reshape(n, depth, blocksize, blocksize, h, w).transpose(0, 1, 4, 2, 5, 3)
    else:
        raise RunnxError(f"DepthToSpace mode '{mode}' is not DCR or CRD")
    return blocked.reshape(n, depth, h * blocksize, w * blocksize)


@register("DepthToSpace", since=1)
def DepthToSpace_1(data, *, blocksize: int):
    return _depth_to_space(data, blocksize, "DCR")


@register("DepthToSpace", since=11)
def DepthToSpace(data, *, blocksize: int, mode: str = "DCR"):
    return _depth_to_space(data, blocksize, mode)


@register("CenterCropPad", since=18)
def CenterCropPad(data, shape, *, axes: tuple[int, ...] | None = None, ctx):
    axes = range(data.ndim) if axes is None else normalize_axes(axes, data.ndim)
    target = int_values(shape)
    if len(target) != len(axes):
        raise RunnxError(f"CenterCropPad shape {target} does not match axes {list(axes)}")
    out_shape = list(data.shape)
    source = [slice(None)] * data.ndim
    dest = [slice(None)] * data.ndim
    for axis, size in zip(axes, target):
        dim = data.shape[axis]
        out_shape[axis] = size
        offset = abs(dim - size) // 2  # centred; an odd difference leaves the extra row at the end
        if size < dim:
            source[axis] = slice(offset, offset + size)
        elif size > dim:
            dest[axis] = slice(offset, offset + dim)
    ctx.check_elements(out_shape, "CenterCropPad output")
    result = np.zeros(out_shape, dtype=data.dtype)
    result[tuple(dest)] = data[tuple(source)]
    return result


@register("Col2Im", since=18)
def Col2Im(data, image_shape, block_shape, *, dilations: tuple[int, ...] | None = None,
           pads: tuple[int, ...] | None = None, strides: tuple[int, ...] | None = None, ctx):
    """Sums the columns (N, C*prod(block), L) back into images (N, C, *image_shape)."""
    image, block = int_values(image_shape), int_values(block_shape)
    spatial = len(image)
    dilations = dilations or (1,) * spatial
    strides = strides or (1,) * spatial
    pads = pads or (0,) * (2 * spatial)
    kernel_size = math.prod(block)
    batch, columns, length = data.shape
    if columns % kernel_size:
        raise RunnxError(f"Col2Im input has {columns} rows, not a multiple of the block size {kernel_size}")
    padded = [size + pads[i] + pads[i + spatial] for i, size in enumerate(image)]
    counts = [(padded[i] - dilations[i] * (block[i] - 1) - 1) // strides[i] + 1 for i in range(spatial)]
    if math.prod(counts) != length or min(counts) < 1:
        raise RunnxError(f"Col2Im input has {length} blocks, the geometry gives {counts}")
    channels = columns // kernel_size
    ctx.check_elements([batch, channels, *padded], "Col2Im output")
    cols = data.reshape(batch, channels, *block, *counts)
    result = np.zeros((batch, channels, *padded), dtype=data.dtype)
    for offset in itertools.product(*(range(b) for b in block)):
        window = tuple(slice(offset[i] * dilations[i], offset[i] * dilations[i] + (counts[i] - 1) * strides[i] + 1,
                             strides[i]) for i in range(spatial))
        result[(slice(None), slice(None), *window)] += cols[(slice(None), slice(None), *offset)]
    return result[(slice(None), slice(None), *(slice(pads[i], pads[i] + image[i]) for i in range(spatial)))]


# numpy keeps these in a byte each, so their widths cannot be compared by itemsize
_SUB_BYTE = {numpy_dtype(t) for t in (TensorProto.INT4, TensorProto.UINT4, TensorProto.FLOAT4E2M1,
                                      TensorProto.INT2, TensorProto.UINT2)}


@register("BitCast", since=26)
def BitCast(x, *, to: int):
    """The same bytes read as another type of the same width: a view, no conversion."""
    target = numpy_dtype(to)
    if x.dtype == object or target == object:
        raise RunnxError("BitCast does not take strings")
    if x.dtype.itemsize != target.itemsize or (_SUB_BYTE & {x.dtype, target}):
        raise RunnxError(f"BitCast from {x.dtype} to {target}: the widths differ or are below a byte")
    return x.view(target)

