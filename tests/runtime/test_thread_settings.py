"""runnx.runtime's thread settings: `set_threads` and `threads`, Options.threads applying them at
load and the profile reporting them; OpenBLAS's threads sleeping after each call from the first load
(or the `runnx` command) on, importing runnx changing nothing; the layers above calling only
runtime's public names."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import threadpoolctl
from onnx import TensorProto, helper

import runnx
from runnx import runtime
from runnx.runtime import pool as decode_pool


def _matmul_model():
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "a"], ["b"])], "g",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_threads_are_applied_and_reported(monkeypatch):
    with threadpoolctl.threadpool_limits(limits=None):  # restores the process's pools afterwards
        try:
            for count in (1, 2):
                model = runnx.load(_matmul_model(), threads=count)
                _, profile = model.run({"a": np.eye(3, dtype=np.float32)}, profile=True)
                assert profile.threads == {"blas": count, "numba": count, "decode": count}
                assert f"threads: BLAS {count}, numba {count}, decode pool {count}" in profile.summary()
                assert decode_pool.worker_count() == count - 1
        finally:
            decode_pool.set_workers(None)
        monkeypatch.setenv("RUNNX_THREADS", "1")
        assert runnx.Options().threads == 1
        monkeypatch.delenv("RUNNX_THREADS")
        assert runnx.Options().threads == 0  # leaves the libraries' settings alone


def test_session_intra_op_threads_become_options_threads():
    with threadpoolctl.threadpool_limits(limits=None):
        settings = runnx.SessionOptions()
        settings.intra_op_num_threads = 1
        session = runnx.InferenceSession(_matmul_model().SerializeToString(), settings)
        assert session.model.options.threads == 1
        assert runnx.InferenceSession(_matmul_model().SerializeToString()).model.options.threads == runnx.Options().threads


def test_set_threads_sets_every_pool_and_threads_reports_them():
    import numba
    numba_threads = numba.get_num_threads()
    with threadpoolctl.threadpool_limits(limits=None):
        try:
            for count in (2, 1):
                runtime.set_threads(count)
                assert runtime.threads() == {"blas": count, "numba": count, "decode": count}
            runtime.set_threads(0)  # leaves them as they are
            assert runtime.threads() == {"blas": 1, "numba": 1, "decode": 1}
        finally:
            decode_pool.set_workers(None)
            numba.set_num_threads(numba_threads)


def test_runnx_set_threads_is_the_runtimes():
    assert runnx.set_threads is runtime.set_threads and "set_threads" in runnx.__all__


@pytest.mark.parametrize("count", [-1, 1.5, "2", True, None])
def test_set_threads_refuses_what_is_not_a_thread_count(count):
    with pytest.raises(runnx.InvalidOptionError, match="threads must be a whole number >= 0"):
        runtime.set_threads(count)


_OPENBLAS = """
import ctypes, threadpoolctl
path = next(c.filepath for c in threadpoolctl.ThreadpoolController().lib_controllers if c.internal_api == "openblas")
library = ctypes.CDLL(path)
"""
# prints what OpenBLAS read at numpy's import, and what a load (argv: runnx or numpy first, another
# thread or not, the model) left: runnx's decision, OpenBLAS's timeout and whether its threads run
_LOAD = """
import json, os, sys, threading
order, case, model = sys.argv[1:]
environment = dict(os.environ)
if order == "runnx-first":
    import runnx
import numpy as np
import runnx
from runnx.runtime import openblas
""" + _OPENBLAS + """
a = np.ones((256, 256), np.float32)
a @ a  # OpenBLAS's threads, started with the timeout it read
read = library.openblas_thread_timeout()
if case == "set-late":  # the user's quick timeout, set after numpy loaded OpenBLAS
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = "4"
    environment = dict(os.environ)
if case == "other-thread":
    threading.Thread(target=threading.Event().wait, args=(60,), daemon=True).start()
runnx.load(model)
print(json.dumps({"read": read, "sleep": openblas.THREADS_SLEEP, "timeout": library.openblas_thread_timeout(),
                  "threads_running": ctypes.c_int.in_dll(library, "blas_server_avail").value,
                  "environment_kept": dict(os.environ) == environment, "product": float((a @ a)[0, 0])}))
"""
_ADVICE = "set OPENBLAS_THREAD_TIMEOUT=4 in the environment before numpy is imported"


def _python(code: str, *args: str, **environment) -> tuple[dict, str]:
    """The last line of `code`'s output (JSON) and its stderr, run with two OpenBLAS threads and
    OPENBLAS_THREAD_TIMEOUT only as `environment` gives it."""
    if not any(c.internal_api == "openblas" for c in threadpoolctl.ThreadpoolController().lib_controllers):
        pytest.skip("numpy's BLAS is not OpenBLAS here")
    left_out = ("OPENBLAS_THREAD_TIMEOUT", "OPENBLAS_NUM_THREADS", "RUNNX_THREADS")
    env = {**{k: v for k, v in os.environ.items() if k not in left_out}, "OPENBLAS_NUM_THREADS": "2", **environment}
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


@pytest.fixture
def matmul_path(tmp_path):
    path = tmp_path / "matmul.onnx"
    path.write_bytes(_matmul_model().SerializeToString())
    return str(path)


def test_importing_runnx_changes_nothing_in_the_process():
    """Not its environment, not even while runnx imports numpy: OpenBLAS reads no timeout (0)."""
    code = ("import json, os\nbefore = dict(os.environ)\nimport runnx\nafter = dict(os.environ)\n" + _OPENBLAS
            + "print(json.dumps([after == before, library.openblas_thread_timeout()]))")
    assert _python(code)[0] == [True, 0]


@pytest.mark.parametrize("order", ["runnx-first", "numpy-first"])
def test_a_load_has_openblas_threads_sleep_after_each_call(order, matmul_path):
    """Unset when OpenBLAS read it: the load has it read the timeout again and stops its threads
    (`blas_server_avail` 0), which its next threaded call starts with it; the environment is left
    as it was."""
    result, stderr = _python(_LOAD, order, "alone", matmul_path)
    assert result == {"read": 0, "sleep": True, "timeout": 4, "threads_running": 0, "environment_kept": True,
                      "product": 256.0}, stderr
    assert _ADVICE not in stderr


def test_with_another_thread_running_a_load_leaves_openblas_threads_spinning(matmul_path):
    """That thread may be inside a BLAS call, which stopping OpenBLAS's threads would hang: nothing
    restarted, and a warning says what to do instead."""
    result, stderr = _python(_LOAD, "numpy-first", "other-thread", matmul_path)
    assert result == {"read": 0, "sleep": False, "timeout": 0, "threads_running": 1, "environment_kept": True,
                      "product": 256.0}, stderr
    assert _ADVICE in stderr and "import runnx first" not in stderr


@pytest.mark.parametrize("given, case, sleep", [("12", "alone", False), ("4", "alone", True),
                                                ("4", "other-thread", True)])
def test_the_users_timeout_is_respected(given, case, sleep, matmul_path):
    """A timeout in the environment is the user's: OpenBLAS's threads keep running as they are (a
    quick one read makes them sleep, with or without other threads), and no warning."""
    result, stderr = _python(_LOAD, "numpy-first", case, matmul_path, OPENBLAS_THREAD_TIMEOUT=given)
    assert result == {"read": int(given), "sleep": sleep, "timeout": int(given), "threads_running": 1,
                      "environment_kept": True, "product": 256.0}, stderr
    assert _ADVICE not in stderr


def test_a_quick_timeout_the_user_set_after_numpy_loaded_openblas_is_read_at_load(matmul_path):
    """OpenBLAS read none; the load has it read the user's, restarting its threads."""
    result, stderr = _python(_LOAD, "numpy-first", "set-late", matmul_path)
    assert result == {"read": 0, "sleep": True, "timeout": 4, "threads_running": 0, "environment_kept": True,
                      "product": 256.0}, stderr


def test_the_command_has_openblas_threads_sleep_before_its_subcommand_runs(matmul_path):
    """`runnx` owns its process: decided before any thread starts (`inspect` loads no model)."""
    code = ("import json, os, sys\nbefore = dict(os.environ)\nimport runnx.cli\nfrom runnx.runtime import openblas\n"
            + _OPENBLAS + "code = runnx.cli.main(['inspect', sys.argv[1]])\n"
            "print(json.dumps([code, openblas.THREADS_SLEEP, library.openblas_thread_timeout(), "
            "dict(os.environ) == before]))")
    assert _python(code, matmul_path)[0] == [0, True, 4, True]


def test_interp_and_generate_import_only_runtimes_public_names():
    """The layers above the runtime call `runnx.runtime`'s names, never one of its modules."""
    package = Path(runnx.__file__).parent
    reaching = []
    for path in [*package.glob("interp/**/*.py"), *package.glob("generate/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("runnx.runtime."):
                reaching.append(f"{path.relative_to(package)}: from {node.module}")
            elif isinstance(node, ast.ImportFrom) and node.module == "runnx.runtime":
                reaching += [f"{path.relative_to(package)}: {a.name}" for a in node.names if a.name not in runtime.__all__]
            elif isinstance(node, ast.Import):
                reaching += [f"{path.relative_to(package)}: {a.name}" for a in node.names
                             if a.name.startswith("runnx.runtime.")]
    assert reaching == []
