"""The official ONNX backend test suite against runnx.backend.

Every CPU case runs (the suite's CUDA variants are removed at collection: runnx runs on the CPU
only, and they would be 2000 skips). The ones listed in backend_expected_failures.txt must fail with
the exception type and message named there: a listed case failing otherwise fails the run, and so
does one that starts passing, so the list stays true (but for random draws, which a draw may match
by chance: it then passes). Each case also checks that runnx never modified the caller's input
arrays, and runs twice: interpreted, then compiled to straight-line Python (interp/compiled.py),
which must give bitwise the same outputs.

RUNNX_BACKEND_INCLUDE=pattern,... keeps only the cases whose name matches one of the regexes.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import unittest
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx.backend.test
import pytest

import runnx.backend

EXPECTED_FAILURES_FILE = Path(__file__).with_name("backend_expected_failures.txt")
RANDOM = re.compile(r"bernoulli|random", re.IGNORECASE)  # unseeded draws differ between runs


@dataclass(frozen=True)
class ExpectedFailure:
    error: str  # the exception's class name (or one of its bases')
    fragment: str  # part of its message
    reason: str

    def matches(self, error: BaseException) -> bool:
        return self.error in {cls.__name__ for cls in type(error).__mro__} and self.fragment in str(error)


def _expected_failures() -> dict[str, ExpectedFailure]:
    entries = {}
    for number, line in enumerate(EXPECTED_FAILURES_FILE.read_text().splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            fields = [field.strip() for field in line.split(" | ")]
            if len(fields) != 4 or not all(fields):
                raise ValueError(f"{EXPECTED_FAILURES_FILE.name}:{number}: expected "
                                 f"`test_name | ExceptionType | message fragment | why`, got {line!r}")
            entries[fields[0]] = ExpectedFailure(*fields[1:])
    return entries


def _checksum(value) -> str:
    digest = hashlib.sha256()
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, np.ndarray):
            digest.update(str((item.shape, item.dtype)).encode())
            digest.update(item.tobytes() if item.dtype != object else repr(item.tolist()).encode())
        else:
            digest.update(repr(item).encode())
    return digest.hexdigest()


class _CheckedRep(runnx.backend.RunnxRep):
    """Asserts that the inputs handed to run() are bitwise unchanged afterwards, and that the
    compiled second run gives what the interpreted first one gave."""

    def run(self, inputs, **kwargs):
        items = list(inputs.values()) if isinstance(inputs, dict) else list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        before = [_checksum(v) for v in items]
        interpreted = super().run(inputs, **kwargs)
        compiled = super().run(inputs, **kwargs)  # Options.compile_after is 2
        after = [_checksum(v) for v in items]
        assert before == after, "runnx modified a caller's input array"
        if not RANDOM.search(self.model.graph.name):
            assert [_checksum(v) for v in compiled] == [_checksum(v) for v in interpreted], \
                "the compiled plan's outputs differ from the interpreted plan's"
        return compiled


class _CheckedBackend(runnx.backend.RunnxBackend):
    @classmethod
    def prepare(cls, model, device="CPU", **kwargs):
        return _CheckedRep(runnx.backend.prepare(model, device, **kwargs).model)


def _expect_failure(method, expected: ExpectedFailure):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            method(self, *args, **kwargs)
        except unittest.SkipTest:
            raise
        except Exception as error:
            if expected.matches(error):
                pytest.xfail(expected.reason)
            raise AssertionError(f"listed in {EXPECTED_FAILURES_FILE.name} as failing with {expected.error} "
                                 f"({expected.fragment!r}), but failed with {type(error).__name__}: {error}") from error
        if expected.reason.startswith("random draws"):  # one sample of a generator: an unseeded draw may match it
            return
        raise AssertionError(f"listed as failing ({expected.reason}) but passes: "
                             f"remove it from {EXPECTED_FAILURES_FILE.name}")

    return wrapper


def _kept(name: str, include: list[str]) -> bool:
    """Whether a generated case is collected: CPU only, and matching RUNNX_BACKEND_INCLUDE when set."""
    if not name.endswith("_cpu"):
        return False
    return not include or any(re.search(pattern, name) for pattern in include)


backend_test = onnx.backend.test.BackendTest(_CheckedBackend, __name__)
_include = list(filter(None, os.environ.get("RUNNX_BACKEND_INCLUDE", "").split(",")))
_failures = _expected_failures()
_cases = backend_test.test_cases  # a property that builds new classes on every access: read it once
_generated = {name for case in _cases.values() for name in dir(case) if name.startswith("test_")}
for _case in _cases.values():
    for _name in [name for name in dir(_case) if name.startswith("test_")]:
        if not _kept(_name, _include):
            delattr(_case, _name)  # not collected: no skip to report
        elif _name in _failures:
            setattr(_case, _name, _expect_failure(getattr(_case, _name), _failures[_name]))
del _case, _name  # or pytest would collect the last case class a second time under this name
globals().update(_cases)


def test_every_expected_failure_names_a_collected_backend_case():
    assert not set(_failures) - _generated, f"unknown cases in {EXPECTED_FAILURES_FILE.name}"
    assert all(name.endswith("_cpu") for name in _failures), "only CPU cases are collected"


def test_the_cpu_cases_are_collected_and_the_cuda_ones_removed():
    assert sum(name.endswith("_cuda") for name in _generated) > 1000  # what the suite generates
    collected = {name for case in _cases.values() for name in dir(case) if name.startswith("test_")}
    assert not any(name.endswith("_cuda") for name in collected)
    if not _include:
        assert collected == {name for name in _generated if name.endswith("_cpu")}


def test_a_listed_case_failing_for_another_reason_fails():
    expected = ExpectedFailure("UnsupportedOpError", "Gradient at opset 1", "not implemented")

    def fails_otherwise(self):
        raise ValueError("a new bug")

    def fails_as_listed(self):
        raise runnx.UnsupportedOpError("ai.onnx.preview.training::Gradient at opset 1: nodes 'g'")

    with pytest.raises(AssertionError, match="failed with ValueError: a new bug"):
        _expect_failure(fails_otherwise, expected)(None)
    with pytest.raises(pytest.xfail.Exception, match="not implemented"):
        _expect_failure(fails_as_listed, expected)(None)
    with pytest.raises(AssertionError, match="but passes: remove it"):
        _expect_failure(lambda self: None, expected)(None)
