"""Under CI=true a skip is a failure unless tests/allowed_skips.txt lists it with its reason, and an
unexpected pass of a non-strict xfail is a failure: a pytest run with the conftest's hook on
small test files, then the allow-list itself against the tests it names."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
TESTS = Path(__file__).resolve().parent


def _root_conftest():
    """tests/conftest.py by its path: `import conftest` may find another folder's (tests/serve/)."""
    spec = importlib.util.spec_from_file_location("runnx_root_conftest", TESTS / "conftest.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


_conftest = _root_conftest()
ALLOWED_SKIPS_FILE, AllowedSkip, read_allowed_skips = (
    _conftest.ALLOWED_SKIPS_FILE, _conftest.AllowedSkip, _conftest.read_allowed_skips)

HOOK = f'''
import importlib.util
import sys
spec = importlib.util.spec_from_file_location("runnx_tests_conftest", {str(TESTS / "conftest.py")!r})
module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
pytest_configure, pytest_runtest_makereport = module.pytest_configure, module.pytest_runtest_makereport
'''
LISTED = '''
import pytest

def test_loop_rounds_each_row_once_as_a_fused_multiply_add():
    pytest.skip("this CPU has no fused multiply-add: LLVM keeps a product and a sum")

def test_listed_name_but_another_reason():
    pytest.skip("some other reason")
'''
UNLISTED = '''
import pytest

@pytest.mark.skipif(True, reason="a condition")
def test_skipped_by_a_marker():
    pass

def test_a_missing_module():
    pytest.importorskip("no_such_module_for_runnx_tests")

@pytest.mark.xfail(reason="said to fail")
def test_passes_though_marked_xfail():
    pass

@pytest.mark.xfail(strict=True, reason="fails as said")
def test_fails_as_marked():
    assert False

def test_passes():
    pass
'''


@pytest.fixture
def suite(pytester):
    pytester.makeconftest(HOOK)
    pytester.mkpydir("tests")  # node ids tests/runtime/..., as in the allow-list
    (pytester.path / "tests" / "runtime").mkdir()
    (pytester.path / "tests" / "runtime" / "test_decode_pool.py").write_text(LISTED)
    (pytester.path / "tests" / "test_unlisted.py").write_text(UNLISTED)
    return pytester


def test_without_ci_skips_stay_skips(suite, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=1, skipped=4, xfailed=1, xpassed=1)


def test_under_ci_only_listed_skips_stay_skips(suite, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-rA")
    # the marker's skip happens in setup: it shows as an error
    result.assert_outcomes(passed=1, skipped=1, xfailed=1, failed=3, errors=1)
    output = result.stdout.str()
    assert re.search(r"SKIPPED .*this CPU has no fused multiply-add", output)
    for name in ("test_listed_name_but_another_reason", "test_a_missing_module", "test_passes_though_marked_xfail"):
        assert re.search(rf"FAILED tests/.*::{name}", output), name
    assert re.search(r"ERROR tests/test_unlisted.py::test_skipped_by_a_marker", output)
    assert "skipped under CI=true (a condition)" in output
    assert "expected to fail (said to fail) but passed" in output


def test_every_allowed_skip_names_a_test_and_is_well_formed(tmp_path):
    entries = read_allowed_skips()
    assert entries
    for entry in entries:
        path = TESTS.parent / entry.pattern.split("::")[0]
        assert path.is_file(), entry
        name = entry.pattern.split("::")[1].rstrip("*")
        assert name == "" or f"def {name}" in path.read_text(), entry
        assert entry.reason in path.read_text(), f"{entry}: no skip in {path} says {entry.reason!r}"
    broken = tmp_path / "allowed.txt"
    broken.write_text("tests/test_x.py::test_y  # no reason fragment\n")
    with pytest.raises(pytest.UsageError, match="NODE_ID_GLOB | SKIP_REASON_FRAGMENT"):
        read_allowed_skips(broken)


def test_an_allowed_skip_needs_both_its_node_and_its_reason():
    entry = AllowedSkip("tests/a.py::test_b[*", "no FMA")
    assert entry.allows("tests/a.py::test_b[float32]", "this CPU has no FMA here")
    assert not entry.allows("tests/a.py::test_b[float32]", "another reason")
    assert not entry.allows("tests/a.py::test_c[float32]", "no FMA")
    assert ALLOWED_SKIPS_FILE.name == "allowed_skips.txt"
