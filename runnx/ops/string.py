"""Strings and text (object arrays of Python str): StringNormalizer, StringConcat, StringSplit,
RegexFullMatch, TfIdfVectorizer (n-gram counts), and the ai.onnx.ml LabelEncoder (a lookup table
between strings, ints and floats)."""
from __future__ import annotations

import operator
import re

import numpy as np

from runnx.errors import InvalidModelError, RunnxError
from runnx.ops.registry import register

ML_DOMAIN = "ai.onnx.ml"

_concat = np.frompyfunc(operator.add, 2, 1)


def _strings(values, shape) -> np.ndarray:
    """An object array of `shape` holding `values` (np.array would guess a fixed-width str dtype)."""
    result = np.empty(shape, dtype=object)
    result[...] = values
    return result


@register("StringNormalizer", since=10)
def StringNormalizer(x, *, case_change_action: str = "NONE", is_case_sensitive: int = 0, locale: str = "",
                     stopwords: tuple[str, ...] | None = None):
    """Drops stopwords, then changes case; [C] -> [C'] or [1, C] -> [1, C'] ([""] when all go)."""
    if not (x.ndim == 1 or x.ndim == 2 and x.shape[0] == 1):
        raise RunnxError(f"StringNormalizer takes shape [C] or [1, C], got {x.shape}")
    change = {"NONE": str, "LOWER": str.lower, "UPPER": str.upper}.get(case_change_action)
    if change is None:
        raise RunnxError(f"case_change_action '{case_change_action}' is not NONE, LOWER or UPPER")
    fold = str if is_case_sensitive else str.casefold
    stops = {fold(word) for word in stopwords or ()}
    kept = [change(s) for s in x.reshape(-1).tolist() if fold(s) not in stops] or [""]
    return _strings(kept, (len(kept),) if x.ndim == 1 else (1, len(kept)))


@register("StringConcat", since=20)
def StringConcat(x, y):
    result = _concat(x, y)
    return result if isinstance(result, np.ndarray) else _strings(result, ())


@register("StringSplit", since=20)
def StringSplit(x, *, delimiter: str | None = None, maxsplit: int | None = None):
    """Splits every string; the parts pad with "" to the longest split, with the counts beside."""
    separator = delimiter or None  # empty or absent: runs of whitespace, as str.split()
    limit = -1 if maxsplit is None else maxsplit
    parts = [s.split(separator, limit) for s in x.reshape(-1).tolist()]
    width = max((len(p) for p in parts), default=0)
    padded = _strings([p + [""] * (width - len(p)) for p in parts] if parts else [], (len(parts), width))
    counts = np.array([len(p) for p in parts], dtype=np.int64)
    return padded.reshape(*x.shape, width), counts.reshape(x.shape)


@register("RegexFullMatch", since=20)
def RegexFullMatch(x, *, pattern: str):
    try:
        regex = re.compile(pattern)
    except re.error as error:
        raise InvalidModelError(f"RegexFullMatch pattern {pattern!r} is not a valid regex: {error}") from None
    return np.array([regex.fullmatch(s) is not None for s in x.reshape(-1).tolist()], dtype=bool).reshape(x.shape)


def _lookup(x, keys, values, default, dtype) -> np.ndarray:
    if len(keys) != len(values):
        raise InvalidModelError(f"LabelEncoder has {len(keys)} keys but {len(values)} values")
    table = dict(zip(keys, values))
    looked_up = [table.get(k, default) for k in x.reshape(-1).tolist()]
    if dtype == object:
        return _strings(looked_up, x.shape)
    return np.array(looked_up, dtype=dtype).reshape(x.shape)


@register("LabelEncoder", since=1, domain=ML_DOMAIN)
def LabelEncoder_1(x, *, classes_strings: tuple[str, ...] = (), default_int64: int = -1,
                   default_string: str = "_Unused"):
    """Version 1: strings -> their index in classes_strings, or ints -> the class string."""
    if x.dtype == object:
        return _lookup(x, classes_strings, range(len(classes_strings)), default_int64, np.int64)
    return _lookup(x, range(len(classes_strings)), classes_strings, default_string, object)


def _table_side(name: str, given: dict) -> tuple[list, np.dtype]:
    """The one keys_* (or values_*) attribute the model sets, as Python values and their dtype."""
    present = [(kind, v) for kind, v in given.items() if v is not None]
    if len(present) != 1:
        raise InvalidModelError(f"LabelEncoder needs exactly one {name}_* attribute, got {len(present)}")
    kind, values = present[0]
    if kind == "tensor":
        return values.reshape(-1).tolist(), values.dtype
    return list(values), {"floats": np.dtype(np.float32), "int64s": np.dtype(np.int64),
                          "strings": np.dtype(object)}[kind]


@register("LabelEncoder", since=2, domain=ML_DOMAIN)
def LabelEncoder(x, *, keys_floats: tuple[float, ...] | None = None, keys_int64s: tuple[int, ...] | None = None,
                 keys_strings: tuple[str, ...] | None = None, keys_tensor: np.ndarray | None = None,
                 values_floats: tuple[float, ...] | None = None, values_int64s: tuple[int, ...] | None = None,
                 values_strings: tuple[str, ...] | None = None, values_tensor: np.ndarray | None = None,
                 default_float: float = -0.0, default_int64: int = -1, default_string: str = "_Unused",
                 default_tensor: np.ndarray | None = None):
    keys, _ = _table_side("keys", {"floats": keys_floats, "int64s": keys_int64s, "strings": keys_strings,
                                   "tensor": keys_tensor})
    values, dtype = _table_side("values", {"floats": values_floats, "int64s": values_int64s,
                                           "strings": values_strings, "tensor": values_tensor})
    if default_tensor is not None:
        default = default_tensor.reshape(-1)[0].item()
    elif dtype == object:
        default = default_string
    elif dtype.kind == "f":
        default = default_float
    else:
        default = default_int64
    if x.dtype.kind == "f":  # float keys compare as the float32 values the model stores
        keys = np.asarray(keys, dtype=np.float32).tolist()
    return _lookup(x, keys, values, default, dtype)


def _ngram_table(pool: list, ngram_counts, ngram_indexes, min_gram: int, max_gram: int) -> dict:
    """n-gram (a tuple) -> output column, for the pool's n-grams of the lengths asked for.

    The pool holds the 1-grams, then the 2-grams, ...; ngram_counts[n-1] is where the n-grams start.
    """
    table, ngram_number = {}, 0
    for n, start in enumerate(ngram_counts, start=1):
        end = ngram_counts[n] if n < len(ngram_counts) else len(pool)
        for first in range(start, end - n + 1, n):
            if min_gram <= n <= max_gram:
                table[tuple(pool[first:first + n])] = ngram_indexes[ngram_number]
            ngram_number += 1
    return table


@register("TfIdfVectorizer", since=9)
def TfIdfVectorizer(x, *, max_gram_length: int, min_gram_length: int, max_skip_count: int, mode: str,
                    ngram_counts: tuple[int, ...], ngram_indexes: tuple[int, ...],
                    pool_int64s: tuple[int, ...] | None = None, pool_strings: tuple[str, ...] | None = None,
                    weights: tuple[float, ...] | None = None):
    """Counts the pool's n-grams (items `skip + 1` apart, skip <= max_skip_count) in each row of
    [C] or [B, C]; TF gives counts, IDF weight-if-present, TFIDF count * weight."""
    if mode not in ("TF", "IDF", "TFIDF"):
        raise InvalidModelError(f"TfIdfVectorizer mode '{mode}' is not TF, IDF or TFIDF")
    if (pool_int64s is None) == (pool_strings is None):
        raise InvalidModelError("TfIdfVectorizer needs exactly one of pool_int64s and pool_strings")
    if x.ndim not in (1, 2):
        raise RunnxError(f"TfIdfVectorizer takes [C] or [B, C], got shape {x.shape}")
    table = _ngram_table(list(pool_int64s if pool_int64s is not None else pool_strings), ngram_counts,
                         ngram_indexes, min_gram_length, max_gram_length)
    width = max(ngram_indexes) + 1
    rows = x.reshape(-1, x.shape[-1]).tolist()
    counts = np.zeros((len(rows), width), dtype=np.float32)
    for r, row in enumerate(rows):
        for distance in range(1, max_skip_count + 2):
            for start in range(len(row)):
                # unigrams do not depend on the distance: count them on the first pass only
                for n in range(max(min_gram_length, 1 if distance == 1 else 2), max_gram_length + 1):
                    last = start + (n - 1) * distance
                    if last >= len(row):
                        break
                    column = table.get(tuple(row[start:last + 1:distance]))
                    if column is not None:
                        counts[r, column] += 1
    if mode != "TF":
        if mode == "IDF":
            counts = (counts > 0).astype(np.float32)
        if weights:
            counts *= np.asarray(weights, dtype=np.float32)
    return counts.reshape(width) if x.ndim == 1 else counts
