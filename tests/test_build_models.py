"""scripts/build_models.py: stamps make reruns instant and catch stale or damaged results; the
audio target builds real clips from PyPI packages alone (the model targets need the export
toolchain: `make models`)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_models.py"


@pytest.fixture(scope="module")
def build_models():
    spec = importlib.util.spec_from_file_location("build_models", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_stamp_tracks_recipe_and_files(build_models, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(b"12345")
    assert not build_models.is_current(folder, "recipe-1")  # no stamp yet
    build_models.write_stamp(folder, "recipe-1")
    stamp = json.loads((folder / ".stamp.json").read_text())
    assert stamp["files"]["model.onnx"]["bytes"] == 5 and len(stamp["files"]["model.onnx"]["sha256"]) == 64
    assert build_models.is_current(folder, "recipe-1")
    assert not build_models.is_current(folder, "recipe-2")  # the recipe changed
    (folder / "model.onnx").write_bytes(b"123")
    assert not build_models.is_current(folder, "recipe-1")  # a truncated file
    (folder / "model.onnx").unlink()
    assert not build_models.is_current(folder, "recipe-1")


def test_publish_replaces_the_final_folder(build_models, tmp_path):
    final, staging = tmp_path / "m", tmp_path / "m.partial"
    final.mkdir()
    (final / "old").write_text("old")
    staging.mkdir()
    (staging / "new").write_text("new")
    build_models.publish(staging, final)
    assert sorted(p.name for p in final.iterdir()) == ["new"] and not staging.exists()


def test_all_means_the_cache_targets(build_models):
    assert build_models.ALL == ("smollm2", "smollm2-int4", "smollm2-genai", "smollm2-tjs", "qwen2", "phi3",
                                 "qwen2-genai", "phi3-genai", "whisper", "whisper-tjs", "whisper-genai", "audio")
    assert set(build_models.TARGETS) == {"tiny", *build_models.ALL}


def test_audio_target_builds_clips_from_pypi_only_then_is_instant_and_repeatable(build_models, tmp_path):
    """No system package: the audio venv (eSpeak NG from a wheel) is all it needs; PATH has no espeak-ng."""
    shared_venv = build_models.cache_root() / "audio-venv"  # `make models` made it: reuse it rather than install again
    if shared_venv.is_dir():
        (tmp_path / "audio-venv").symlink_to(shared_venv)
    env = dict(os.environ, RUNNX_CACHE=str(tmp_path), PATH=str(Path(sys.executable).parent))
    first = subprocess.run([sys.executable, SCRIPT, "audio"], capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0, first.stderr
    audio = tmp_path / "audio"
    transcripts = json.loads((audio / "transcripts.json").read_text())
    assert transcripts["john.wav"] == "Hello, my name is John and I live in London."
    for name in transcripts:
        with wave.open(str(audio / name)) as clip:
            assert (clip.getframerate(), clip.getnchannels(), clip.getsampwidth()) == (16000, 1, 2)
            seconds = clip.getnframes() / clip.getframerate()
            samples = np.frombuffer(clip.readframes(clip.getnframes()), np.int16)
        assert seconds > 60 if name == "long.wav" else 1 < seconds < 10
        assert np.abs(samples).max() > 8000  # speech, not silence
    second = subprocess.run([sys.executable, SCRIPT, "audio"], capture_output=True, text=True, env=env, timeout=60)
    assert second.returncode == 0 and "audio: up to date" in second.stdout
    stamp = (audio / ".stamp.json").read_text()
    again = subprocess.run([sys.executable, SCRIPT, "audio", "--force"], capture_output=True, text=True, env=env,
                           timeout=600)
    assert again.returncode == 0, again.stderr
    assert (audio / ".stamp.json").read_text() == stamp  # the same sha256 for every clip


def test_unknown_target_is_a_usage_error():
    result = subprocess.run([sys.executable, SCRIPT, "nonsense"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "invalid choice: 'nonsense'" in result.stderr
