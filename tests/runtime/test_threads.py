"""Options.threads: BLAS, numba and decode-pool threads set at load and reported in the profile."""
import os

import numpy as np
import threadpoolctl
from onnx import TensorProto, helper

import runnx
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
