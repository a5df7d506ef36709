"""Session fixtures shared by all tests: where the committed tiny models and the real models are.

- `fixtures_dir`: tests/fixtures (tiny random-weight models, committed; see its README.md).
- `smollm2_dir`, `smollm2_int4_dir`, `whisper_dir`, `audio_dir`: what `make models` (scripts/build_models.py) builds
  into ${RUNNX_CACHE:-~/.cache/runnx}. When absent the test is skipped ("run `make models`
  first"), except under CI=true, where a missing model is a failure: CI must test them.
Tests that use these are marked `real_model` automatically (deselect with -m "not real_model").
RUNNX_COMPILE defaults to `wait` here: a CLI command in a test compiles its kernels itself.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# the CLI's commands called in a test compile on first use: no compiling process of their own
# (runnx/background_compile.py; tests of that mechanism set it themselves)
os.environ.setdefault("RUNNX_COMPILE", "wait")
REAL_MODEL_FIXTURES = ("smollm2_dir", "smollm2_int4_dir", "whisper_dir", "audio_dir")


def cache_root() -> Path:
    """The same rule as scripts/build_models.py."""
    return Path(os.environ.get("RUNNX_CACHE") or Path.home() / ".cache" / "runnx").expanduser()


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: needs a real model built by `make models` (SmolLM2-135M, "
                                       "Whisper tiny.en); skipped when absent")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(name in REAL_MODEL_FIXTURES for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)


def built(folder: Path, what: str, files: tuple[str, ...]) -> Path:
    """`folder` if build_models.py finished it (its stamp is written last), else skip (fail under CI)."""
    missing = [name for name in (".stamp.json", *files) if not (folder / name).is_file()]
    if missing:
        reason = f"{what} not built ({folder / missing[0]} is missing): run `make models` first"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; under CI=true the real models must be there", pytrace=False)
        pytest.skip(reason)
    return folder


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return built(cache_root() / "models" / "smollm2-135m", "SmolLM2-135M",
                 ("model.onnx", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"))


@pytest.fixture(scope="session")
def smollm2_int4_dir() -> Path:
    return built(cache_root() / "models" / "smollm2-135m-int4", "SmolLM2-135M int4",
                 ("model.onnx", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"))


@pytest.fixture(scope="session")
def whisper_dir() -> Path:
    return built(cache_root() / "models" / "whisper-tiny.en", "Whisper tiny.en",
                 ("encoder_model.onnx", "decoder_model_merged.onnx", "config.json", "generation_config.json",
                  "tokenizer.json", "preprocessor_config.json"))


@pytest.fixture(scope="session")
def audio_dir() -> Path:
    return built(cache_root() / "audio", "The speech clips", ("john.wav", "long.wav", "transcripts.json"))
