"""`import runnx` stays quick: the slow imports (numba and llvmlite, onnx and the ml_dtypes it
imports, tokenizers, the audio libraries) and the op families load when a model or a command
first needs them, and everything still works after such a bare import."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import runnx

ROOT = Path(__file__).resolve().parents[1]
# top-level modules `import runnx` must not load (each takes 0.1-3 s to import)
SLOW = ("numba", "llvmlite", "ml_dtypes", "onnx", "tokenizers", "soundfile", "soxr", "threadpoolctl")


def python(*args: str) -> subprocess.CompletedProcess:
    """This interpreter on this tree (a fresh process: nothing imported yet)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600, check=True)


def test_import_runnx_loads_none_of_the_slow_modules():
    report = python("-X", "importtime", "-c", "import runnx").stderr
    imported = {line.split("|")[-1].strip() for line in report.splitlines() if line.startswith("import time:")}
    assert "runnx" in imported and "runnx.interp.model" in imported  # the report is what it seems
    slow = sorted(name for name in imported if name.split(".")[0] in SLOW)
    assert slow == []
    families = [name for name in imported if name.startswith("runnx.ops.")
                 and not name.split(".")[2].startswith("_") and name != "runnx.ops.registry"]
    assert families == [], "op families load with the first model, not with runnx"


def test_after_a_bare_import_a_model_loads_and_runs():
    """The registry fills on first use: the tiny Llama's ops (and its fused kernels) resolve."""
    model = ROOT / "tests" / "fixtures" / "tiny-llama" / "model.onnx"
    out = python("-c", f"""
import sys
import runnx
assert "numba" not in sys.modules
from runnx.cli import main
main(["run", {str(model)!r}])
assert "numba" in sys.modules
""").stdout
    assert "logits" in out and "float32[1, 1, " in out


def test_every_public_name_is_there():
    for name in runnx.__all__:
        assert getattr(runnx, name) is not None, name
    from runnx import with_capacity  # loaded on first use (it compiles a kernel)
    assert with_capacity([[1.0, 2.0]], axis=1, capacity=8).array.base.shape == (1, 8)
