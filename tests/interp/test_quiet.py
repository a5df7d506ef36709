"""The models' busy blocks and the quiet a background chore waits for (`interp/quiet.py`)."""
from __future__ import annotations

import threading
import time

import numpy as np
import onnx
from onnx import TensorProto, helper

import runnx
from runnx.interp.quiet import BUSY, wait_quiet


def test_busy_blocks_nest_and_quiet_starts_when_the_last_ends():
    with BUSY:
        with BUSY:
            assert BUSY.quiet_for() == 0.0
        assert BUSY.quiet_for() == 0.0  # the outer block is still open
    assert 0.0 <= BUSY.quiet_for() < 0.5
    time.sleep(0.05)
    assert BUSY.quiet_for() >= 0.05


def test_wait_quiet_waits_for_a_busy_block_on_another_thread_then_the_quiet_time():
    entered, leave = threading.Event(), threading.Event()

    def work():
        with BUSY:
            entered.set()
            leave.wait(5)

    worker = threading.Thread(target=work)
    worker.start()
    entered.wait(5)
    ended = []
    waiter = threading.Thread(target=lambda: (wait_quiet(0.1), ended.append(time.monotonic())))
    waiter.start()
    time.sleep(0.2)
    assert not ended  # busy: no quiet yet
    left = time.monotonic()
    leave.set()
    worker.join()
    waiter.join(5)
    assert ended and ended[0] - left >= 0.09


def _tiny_model(tmp_path):
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_loads_and_runs_are_busy(tmp_path):
    """A load and each run restart the quiet time: a chore waiting for quiet (weights settling into
    huge pages) never shares the cores with them."""
    path = _tiny_model(tmp_path)
    time.sleep(0.15)
    model = runnx.load(path)
    assert BUSY.quiet_for() < 0.15
    time.sleep(0.15)
    assert BUSY.quiet_for() >= 0.15
    model.run({"x": np.array([-1.0, 2.0], np.float32)})
    assert BUSY.quiet_for() < 0.15


def test_a_decoder_step_is_busy_before_its_run(fixtures_dir, monkeypatch):
    """A step is busy from its start, its KV cache's allocation included: a settling collapse beside
    that allocation stalled each heap growth for a huge page's collapse (a first prompt one second
    after the load: 156-164 ms against 78-88)."""
    from runnx.generate import kv_cache
    from runnx.generate.decoder import DecoderStep, load_decoder
    seen = []
    allocate = kv_cache._allocate
    monkeypatch.setattr(kv_cache, "_allocate", lambda *a, **k: (seen.append(BUSY.quiet_for()), allocate(*a, **k))[1])
    decoder = DecoderStep(load_decoder(str(fixtures_dir / "tiny-llama" / "model.onnx")))
    time.sleep(0.02)
    decoder.step(np.array([[1, 2, 3]], np.int64))
    assert seen and all(quiet == 0.0 for quiet in seen)


def test_a_transcription_is_busy_from_its_audio_on(fixtures_dir, monkeypatch):
    """So is a transcription, from before its audio's features (the windows' arrays after them)."""
    from runnx.generate import whisper
    seen = []
    features = whisper.log_mel_spectrogram
    monkeypatch.setattr(whisper, "log_mel_spectrogram",
                        lambda *a, **k: (seen.append(BUSY.quiet_for()), features(*a, **k))[1])
    model = whisper.Whisper(fixtures_dir / "tiny-whisper")
    time.sleep(0.02)
    model.transcribe(np.zeros(16000, np.float32), max_new_tokens=4)
    assert seen == [0.0]
