"""Reader for CTranslate2's `model.bin` (binary format version 6, as written by
ctranslate2/specs/model_spec.py), so that a CTranslate2 conversion can be turned back into a
Hugging Face model without ctranslate2's own (write-only) converters.

Layout, little-endian:
    u32 version; str spec_name; u32 revision; u32 variable_count
    per variable: str name; u8 rank; u32 dims[rank]; u8 dtype_id; u32 byte_count; bytes data
    u32 alias_count; per alias: str alias; str target
where str = u16 length (including a trailing NUL) + UTF-8 bytes + NUL.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

# dtype ids of the format; bfloat16 (5) is widened to float32 by hand below.
DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: "bfloat16"}


@dataclass
class Ct2Model:
    version: int
    spec: str
    revision: int
    variables: dict[str, np.ndarray]
    aliases: dict[str, str]


class _Cursor:
    def __init__(self, data: bytes):
        self.data, self.offset = data, 0

    def unpack(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("H")
        text = self.data[self.offset:self.offset + length - 1].decode("utf-8")
        self.offset += length
        return text

    def take(self, count: int) -> bytes:
        chunk = self.data[self.offset:self.offset + count]
        self.offset += count
        return chunk


def _decode(raw: bytes, dtype_id: int) -> np.ndarray:
    dtype = DTYPES[dtype_id]
    if dtype == "bfloat16":  # bfloat16 is the upper half of a float32
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, dtype)


def read_ct2(path) -> Ct2Model:
    with open(path, "rb") as file:
        cursor = _Cursor(file.read())
    version = cursor.unpack("I")
    if version != 6:
        raise ValueError(f"{path}: CTranslate2 binary version {version}, this reader knows version 6")
    spec, revision = cursor.string(), cursor.unpack("I")
    variables = {}
    for _ in range(cursor.unpack("I")):
        name = cursor.string()
        shape = tuple(cursor.unpack("I") for _ in range(cursor.unpack("B")))
        dtype_id = cursor.unpack("B")
        array = _decode(cursor.take(cursor.unpack("I")), dtype_id)
        variables[name] = array.reshape(shape)
    aliases = {}
    for _ in range(cursor.unpack("I")):
        alias = cursor.string()
        aliases[alias] = cursor.string()
    if cursor.offset != len(cursor.data):
        raise ValueError(f"{path}: {len(cursor.data) - cursor.offset} trailing bytes after the aliases")
    return Ct2Model(version, spec, revision, variables, aliases)
