"""Compiled kernels off (`runnx/ops/_native.py`): every op takes its numpy path, computes what the
compiled kernels compute, calls no numba function, and the switch back takes effect at the next op."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import runnx
from runnx.cli import complete_feeds
from runnx.generate.audio import load_audio
from runnx.generate.generator import Generator
from runnx.generate.mel import window_features
from runnx.generate.whisper import Whisper
from runnx.ops import _native, fused_norms
from runnx.runtime import pool as decode_pool

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def native_off():
    _native.disable()
    yield
    _native.enable()


def _outputs(path: Path, native: bool, sequence: int = 1) -> dict:
    """The model's outputs on the CLI's generated inputs, every sequence dimension `sequence` long."""
    model = runnx.load(path, check_symbolic_dims=False)
    dims = {dim: sequence for info in model.inputs for dim in (info.shape or ())
            if isinstance(dim, str) and dim.isidentifier() and "sequence" in dim}
    with contextlib.redirect_stdout(io.StringIO()):  # the CLI's notes on what it generated
        feeds = complete_feeds(model, {}, dims, 0)
    if native:
        return model.run(feeds)
    _native.disable()
    try:
        return model.run(feeds)
    finally:
        _native.enable()


@pytest.mark.parametrize("sequence", [1, 5])
@pytest.mark.parametrize("name", ["tiny-llama/model.onnx", "tiny-gpt2/model.onnx",
                                  "tiny-llama-merged/decoder_model_merged.onnx", "tiny-whisper/encoder_model.onnx",
                                  "tiny-whisper/decoder_model_merged.onnx"])
def test_numpy_paths_compute_what_the_kernels_compute(fixtures_dir, name, sequence):
    compiled = _outputs(fixtures_dir / name, True, sequence)
    numpy = _outputs(fixtures_dir / name, False, sequence)
    assert compiled.keys() == numpy.keys()
    for key in compiled:
        # the attention kernels reorder their sums and the SiLU gate has its own exp: a few ulp apart
        np.testing.assert_allclose(numpy[key], compiled[key], rtol=1e-5, atol=2e-6, err_msg=key)


def test_generation_and_transcription_alike_either_way(fixtures_dir):
    def generated():
        generator = Generator.from_folder(fixtures_dir / "tiny-llama")
        return generator.generate("Once upon a time", max_new_tokens=12)

    def transcribed():
        model = Whisper(fixtures_dir / "tiny-whisper")
        features = window_features(load_audio(fixtures_dir / "whisper_features" / "clip.wav"))
        return model.decode(model.encode(features), max_new_tokens=20).tokens

    compiled = generated(), transcribed()
    _native.disable()
    try:
        numpy = generated(), transcribed()
    finally:
        _native.enable()
    assert numpy == compiled


def test_the_switch_takes_effect_at_the_next_op(monkeypatch, native_off):
    calls = []
    kernel = fused_norms.rms_norm_into
    monkeypatch.setattr(fused_norms, "rms_norm_into", lambda *a: calls.append(1) or kernel(*a))
    x = np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32)
    epsilon, one, weight = np.float32(1e-6), np.float32(1.0), np.linspace(0.5, 1.5, 8, dtype=np.float32)
    numpy = fused_norms.RMSNorm(x, weight, epsilon=epsilon, one=one)
    assert not calls and decode_pool.pool() is None
    _native.enable()
    compiled = fused_norms.RMSNorm(x, weight, epsilon=epsilon, one=one)
    assert calls == [1]
    np.testing.assert_allclose(numpy, compiled, rtol=1e-6)


def test_numpy_paths_call_no_numba_function(fixtures_dir, tmp_path):
    """A fresh process with compiled kernels off, numba's dispatch trapped: running every fixture
    model, a generation and a transcription never reaches a numba function (compiled or cached)."""
    script = textwrap.dedent(f"""
        import sys
        from numba.core import dispatcher
        def trapped(self, *args, **kws):
            raise AssertionError(f"numba called: {{self.py_func.__module__}}.{{self.py_func.__name__}}")
        dispatcher.Dispatcher._compile_for_args = trapped
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import test_native
        from runnx.ops import _native
        from pathlib import Path
        fixtures = Path({str(fixtures_dir)!r})
        for name in ("tiny-llama/model.onnx", "tiny-gpt2/model.onnx", "tiny-llama-merged/decoder_model_merged.onnx",
                     "tiny-whisper/encoder_model.onnx", "tiny-whisper/decoder_model_merged.onnx"):
            test_native._outputs(fixtures / name, False)
            test_native._outputs(fixtures / name, False, 5)
        _native.disable()
        from runnx.generate.generator import Generator
        print(Generator.from_folder(fixtures / "tiny-llama").generate("Once upon a time", max_new_tokens=6))
        from runnx.generate.whisper import Whisper
        print(Whisper(fixtures / "tiny-whisper").transcribe(fixtures / "whisper_features" / "clip.wav").text)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
