"""External tensor data and safetensors weights, confined to the model folder.

Only relative paths inside the model's folder are accepted: absolute paths, `..` escapes and
symlinks are refused, and every (offset, length) must lie inside the file. Nothing is unpickled.

A graph's float initializers in a data file are read into anonymous memory that settles in huge
pages (`model_file.weight_arena`, as a model file's own initializers are), one map a file, when
they take a huge page or more and at most half the memory available: a decode step streams every
such weight, and a file's map stays in 4 KiB pages (the kernel collapses no read-only file map
here), whose TLB misses made a float32 135M-parameter decoder's step from onnxruntime-genai's
folder 4-19% slower. Other tensors (indices, packed bytes), float ones no node streams as stored
(the loader leaves them out: an embedding is read a few rows a step, a 4-bit weight's scales are
repacked with it) and files memory could not hold twice are memory-mapped. A mapped tensor that a
kernel has copied into a layout of its own (a 4-bit weight's tiles) hands its pages back
(`release_pages`): the file still holds its bytes, and reading them again faults them in again.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import weakref

import numpy as np
from onnx import TensorProto

from runnx.errors import ExternalDataError
from runnx.interp.model_file import HUGE_PAGE, owning_array, read_ranges

SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16,
    "U8": np.uint8, "BOOL": np.bool_,
}


_FILE_MAPS: weakref.WeakSet = weakref.WeakSet()  # the read-only maps of files made here (`_map_file`)


def _map_file(path: str) -> mmap.mmap | bytes:
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return b""
        data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    _FILE_MAPS.add(data)
    return data


def in_file_map(array: np.ndarray) -> bool:
    """Whether an array's bytes lie in a file's read-only map made here (`_map_file`)."""
    return _file_map_of(array) is not None


def _file_map_of(array: np.ndarray) -> mmap.mmap | None:
    root = owning_array(array)
    data = root.base.obj if isinstance(root.base, memoryview) else root.base
    return data if isinstance(data, mmap.mmap) and data in _FILE_MAPS and not data.closed else None


def release_pages(array: np.ndarray) -> int:
    """Hand back to the kernel this process's pages that lie wholly inside the bytes of a
    C-contiguous array, when those lie in a file's read-only map made here (`_map_file`: a data
    file, a safetensors file): the file holds them, and anything reading them again faults them in
    again from it, so nothing is lost. Memory anywhere else (runnx's arenas, a caller's array), whose
    pages hold the only copy, is never touched. Returns the bytes handed back."""
    data = _file_map_of(array)
    if data is None or not array.flags.c_contiguous or not hasattr(data, "madvise"):
        return 0
    offset = array.__array_interface__["data"][0] - np.frombuffer(data, np.uint8).__array_interface__["data"][0]
    if offset < 0 or offset + array.nbytes > len(data):
        return 0
    first, stop = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE, (offset + array.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if stop <= first:
        return 0
    data.madvise(mmap.MADV_DONTNEED, first, stop - first)
    return stop - first


# element types a product streams as stored (read into a weight arena)
_STREAMED = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE})


def _available_memory() -> int:
    """Bytes the kernel could give without swapping (MemAvailable), 0 where it does not say."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def confined_path(folder: str, location: str, what: str) -> str:
    """The real path of `location` inside `folder`, or ExternalDataError."""
    if type(location) is not str or "\0" in location:  # protobuf gives invalid UTF-8 as bytes
        raise ExternalDataError(f"{what}: external data path {location!r} is not a valid file name")
    if not location or os.path.isabs(location) or location.startswith(("/", "\\")) or ":" in location[:3]:
        raise ExternalDataError(f"{what}: external data path '{location}' must be relative to the model folder")
    parts = location.replace("\\", "/").split("/")
    if ".." in parts:
        raise ExternalDataError(f"{what}: external data path '{location}' escapes the model folder")
    folder = os.path.realpath(folder)
    path = os.path.join(folder, *parts)
    probe = folder
    for part in parts:
        probe = os.path.join(probe, part)
        if os.path.islink(probe):
            raise ExternalDataError(f"{what}: external data path '{location}' goes through a symlink")
    if os.path.commonpath([folder, os.path.realpath(path)]) != folder:
        raise ExternalDataError(f"{what}: external data path '{location}' escapes the model folder")
    if not os.path.isfile(path):
        raise ExternalDataError(f"{what}: external data file '{location}' not found in {folder}")
    return path


class ExternalData:
    """Reads tensors stored outside the protobuf, from files in the model's folder: read ahead into
    weight arenas (`read_ahead`) or memory-mapped."""

    def __init__(self, folder: str):
        self.folder = folder
        self._maps: dict[str, object] = {}
        # location -> its checked path: a model's hundreds of tensors name one or a few files, and
        # each check resolves every part of the path (a dozen system calls)
        self._paths: dict[str, str] = {}
        self._sizes: dict[str, int] = {}
        self._read: dict[tuple[str, int, int], np.ndarray] = {}  # (path, offset, length) -> bytes read ahead

    def read_ahead(self, tensors) -> None:
        """Read the float tensors among `tensors` (a graph's initializers) stored in data files into
        one weight arena a file (`model_file.read_ranges`), where a file's share is a huge page or
        more and at most half the memory available; `read` then gives those bytes. Anything
        malformed is left for `read` to report."""
        spans: dict[str, list[tuple[int, int]]] = {}
        for tensor in tensors:
            if tensor.data_location != TensorProto.EXTERNAL or tensor.data_type not in _STREAMED:
                continue
            try:
                path, offset, length = self._span(tensor)
            except ExternalDataError:
                continue
            spans.setdefault(path, []).append((offset, length))
        for path, ranges in spans.items():
            total = sum(length for _, length in ranges)
            if HUGE_PAGE <= total and 2 * total <= _available_memory():
                try:
                    with open(path, "rb") as handle:
                        buffers = read_ranges(handle, ranges)
                except OSError:
                    continue
                if buffers is not None:  # (else the file shrank since: `read` maps it and reports)
                    self._read.update({(path, *span): buffer for span, buffer in zip(ranges, buffers)})

    def read(self, tensor):
        span = self._span(tensor)
        read = self._read.get(span)
        if read is not None:
            return memoryview(read)
        path, offset, length = span
        if path not in self._maps:
            try:
                self._maps[path] = _map_file(path)
            except OSError as error:
                raise ExternalDataError(f"tensor '{tensor.name}': cannot read external data file: {error}") from None
        data = self._maps[path]
        if offset + length > len(data):
            raise ExternalDataError(f"tensor '{tensor.name}': bytes [{offset}, {offset + length}) lie outside "
                                    f"'{os.path.basename(path)}' ({len(data)} bytes): it changed while loading")
        return memoryview(data)[offset:offset + length]

    def _span(self, tensor) -> tuple[str, int, int]:
        """(checked path, offset, length) of a tensor's external data, or ExternalDataError."""
        entries = {e.key: e.value for e in tensor.external_data}
        what = f"tensor '{tensor.name}'"
        location = entries.get("location", "")
        path = self._paths.get(location) if type(location) is str else None
        if path is None:
            path = self._paths[location] = confined_path(self.folder, location, what)
        size = self._sizes.get(path)
        if size is None:
            try:
                size = self._sizes[path] = os.path.getsize(path)
            except OSError as error:
                raise ExternalDataError(f"{what}: cannot read external data file: {error}") from None
        try:
            offset = int(entries.get("offset", 0))
            length = int(entries["length"]) if "length" in entries else size - offset
        except ValueError:
            raise ExternalDataError(f"{what}: offset/length are not integers: {entries}") from None
        if offset < 0 or length < 0 or offset + length > size:
            raise ExternalDataError(
                f"{what}: bytes [{offset}, {offset + length}) lie outside '{entries['location']}' ({size} bytes)")
        return path, offset, length


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Read-only, zero-copy arrays from a .safetensors file, with its header validated."""
    try:
        data = _map_file(path)
    except (OSError, ValueError) as error:  # ValueError: a NUL byte in the path
        raise ExternalDataError(f"cannot open weights file '{path}': {error}") from None
    if len(data) < 8:
        raise ExternalDataError(f"'{path}' is not a safetensors file (too short)")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8 or header_len > 100 * 2**20:
        raise ExternalDataError(f"'{path}': safetensors header length {header_len} exceeds the file")
    try:
        header = json.loads(bytes(data[8:8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ExternalDataError(f"'{path}': safetensors header is not valid JSON: {error}") from None
    if not isinstance(header, dict):
        raise ExternalDataError(f"'{path}': safetensors header is not a JSON object")
    body = memoryview(data)[8 + header_len:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = np.dtype(SAFETENSORS_DTYPES[info["dtype"]])
            shape = tuple(int(d) for d in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ExternalDataError(f"'{path}': tensor '{name}' has a malformed or unsupported header entry {info}") from None
        count = int(np.prod(shape, dtype=np.int64))
        if any(d < 0 for d in shape) or not 0 <= start <= end <= len(body) or end - start != count * dtype.itemsize:
            raise ExternalDataError(
                f"'{path}': tensor '{name}' {info['dtype']}{list(shape)} does not match its byte range [{start}, {end})")
        array = np.frombuffer(body[start:end], dtype=dtype, count=count).reshape(shape)
        array.flags.writeable = False
        tensors[name] = array
    return tensors
