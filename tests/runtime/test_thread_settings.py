"""runnx.runtime's thread settings: `set_threads` and `threads`, Options.threads applying them at
load and the profile reporting them; OpenBLAS's timeout set before numpy loads; the layers above
calling only runtime's public names."""
import ast
import os
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


def test_importing_runnx_first_makes_openblas_threads_sleep_after_each_call():
    """OpenBLAS reads its spin timeout when numpy loads it: runnx sets a short one unless told."""
    import subprocess
    import sys
    code = "import runnx, os; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    for given, expected in ((None, "4"), ("12", "12")):
        if given is not None:
            env["OPENBLAS_THREAD_TIMEOUT"] = given
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert done.stdout.split() == [expected], done.stderr


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


def test_import_runnx_sets_the_timeout_before_numpy_loads_openblas():
    """runnx imports runtime.openblas first: OpenBLAS has not read its variables yet then."""
    import subprocess
    import sys
    code = "import runnx.runtime.openblas as o; print(o.THREADS_SLEEP)"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["True"], done.stderr


_NUMPY_FIRST = """
import ctypes, sys, threading
import numpy as np
import threadpoolctl
a = np.ones((256, 256), np.float32)
a @ a  # OpenBLAS's threads, started with its default timeout
import runnx
from runnx.runtime import openblas
path = [c.filepath for c in threadpoolctl.ThreadpoolController().lib_controllers if c.internal_api == "openblas"][0]
library = ctypes.CDLL(path)
if sys.argv[1] == "other-thread":
    threading.Thread(target=threading.Event().wait, args=(60,), daemon=True).start()
print(openblas.THREADS_SLEEP, library.openblas_thread_timeout())
runnx.load(sys.argv[2])
print(openblas.THREADS_SLEEP, library.openblas_thread_timeout(),
      ctypes.c_int.in_dll(library, "blas_server_avail").value)
print(float((a @ a)[0, 0]))
"""


@pytest.mark.parametrize("case", ["alone", "other-thread"])
def test_a_process_that_imported_numpy_first_gets_openblas_threads_sleeping_at_load(case, tmp_path):
    """OpenBLAS read its variables before runnx set the timeout: runnx.load has it read them again
    and stops its threads (none running: `blas_server_avail` 0), so its next threaded call starts
    them with the timeout; not while a thread that is not runnx's may be inside a BLAS call, which
    a warning says (once) with what to do instead."""
    import subprocess
    import sys
    if not any(c.internal_api == "openblas" for c in threadpoolctl.ThreadpoolController().lib_controllers):
        pytest.skip("numpy's BLAS is not OpenBLAS here")
    onnx_path = tmp_path / "matmul.onnx"
    onnx_path.write_bytes(_matmul_model().SerializeToString())
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "OPENBLAS_NUM_THREADS")}
    env["OPENBLAS_NUM_THREADS"] = "2"
    done = subprocess.run([sys.executable, "-c", _NUMPY_FIRST, case, str(onnx_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = done.stdout.splitlines()
    assert lines[0] == "False 0", done.stderr  # (0: the variable was not set when OpenBLAS read it)
    assert lines[1] == ("True 4 0" if case == "alone" else "False 0 1"), done.stderr
    assert lines[2] == "256.0"  # a product after the threads stopped
    # left spinning: the user is told how to have them sleep
    assert ("set OPENBLAS_THREAD_TIMEOUT=4 in the environment" in done.stderr) == (case == "other-thread")


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
