"""Session fixtures shared by all tests: where the committed tiny models and the real models are.

- `fixtures_dir`: tests/fixtures (tiny random-weight models, committed; see its README.md).
- `smollm2_dir`, `qwen2_dir`, `phi3_dir` (SmolLM2's weights as Qwen2 and Phi-3 exports),
  `smollm2_int4_dir`, `smollm2_genai_fp32_dir`, `smollm2_genai_int4_dir`, `qwen2_genai_fp32_dir`,
  `phi3_genai_fp32_dir`, `qwen2_genai_int4_dir`, `phi3_genai_int4_dir` (onnxruntime-genai folders), `smollm2_tjs_dir`, `whisper_tjs_dir` (transformers.js
  layout), `whisper_dir`, `whisper_genai_dir` (onnxruntime-genai's Whisper folder), `audio_dir`: what
  `make models` (scripts/build_models.py) builds into ${RUNNX_CACHE:-~/.cache/runnx}. When absent the test
  is skipped ("run `make models` first"), except under CI=true, where a missing model is a failure: CI
  must test them.
Tests that use these are marked `real_model` automatically (deselect with -m "not real_model").
RUNNX_COMPILE defaults to `wait` here: a CLI command in a test compiles its kernels itself.

Under CI=true (.ci/run sets it) a skip is a failure unless tests/allowed_skips.txt lists it with its
reason, and an unexpected pass of a non-strict xfail is a failure too: a green CI means every test
ran and said what it should.
"""
from __future__ import annotations

import os

# before numpy loads OpenBLAS, which reads it then: beside xdist's threads a load would leave OpenBLAS's spinning
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# the CLI's commands called in a test compile on first use: no compiling process of their own
# (runnx/background_compile.py; tests of that mechanism set it themselves)
os.environ.setdefault("RUNNX_COMPILE", "wait")
REAL_MODEL_FIXTURES = ("smollm2_dir", "qwen2_dir", "phi3_dir", "smollm2_int4_dir", "smollm2_genai_fp32_dir",
                       "smollm2_genai_int4_dir", "qwen2_genai_fp32_dir", "phi3_genai_fp32_dir", "qwen2_genai_int4_dir",
                       "phi3_genai_int4_dir", "smollm2_tjs_dir", "whisper_dir", "whisper_tjs_dir", "whisper_genai_dir",
                       "audio_dir")
ALLOWED_SKIPS_FILE = Path(__file__).with_name("allowed_skips.txt")
ALLOWED_SKIPS = pytest.StashKey[list]()  # the file's entries, read once per session


def under_ci() -> bool:
    return os.environ.get("CI") == "true"


@dataclass(frozen=True)
class AllowedSkip:
    pattern: str  # fnmatch glob on the pytest node id
    reason: str  # a fragment of the skip's own reason

    def allows(self, node_id: str, reason: str) -> bool:
        return fnmatchcase(node_id, self.pattern) and self.reason in reason


def read_allowed_skips(path: Path = ALLOWED_SKIPS_FILE) -> list[AllowedSkip]:
    """`NODE_ID_GLOB | SKIP_REASON_FRAGMENT` lines; blank lines and # comments ignored."""
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            pattern, separator, reason = (part.strip() for part in line.partition(" | "))
            if not separator or not pattern or not reason:
                raise pytest.UsageError(f"{path}:{number}: expected `NODE_ID_GLOB | SKIP_REASON_FRAGMENT`, "
                                        f"got {line!r}")
            entries.append(AllowedSkip(pattern, reason))
    return entries


def skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def ci_verdict(node_id: str, report, allowed: list[AllowedSkip]) -> str | None:
    """Why `report` must count as a failure under CI=true, or None when it stands."""
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = skip_reason(report)
        if not any(entry.allows(node_id, reason) for entry in allowed):
            return (f"skipped under CI=true ({reason}), and {ALLOWED_SKIPS_FILE.name} does not allow it: "
                    f"make it run, or list it there with its reason")
    if report.passed and hasattr(report, "wasxfail"):
        return f"expected to fail ({report.wasxfail}) but passed: remove the xfail marker, or make it strict"
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if under_ci():
        verdict = ci_verdict(item.nodeid, report, item.config.stash[ALLOWED_SKIPS])
        if verdict is not None:
            report.outcome, report.longrepr = "failed", verdict



@pytest.fixture(autouse=True)
def compiled_kernels_on():
    """Every test starts with numba's kernels on (`runnx/ops/_native.py`): a test of the numpy
    paths or of the first-run switch that left them off would change what later tests in its
    worker compare (the pool's bitwise checks against one-thread jobs)."""
    from runnx.ops import _native
    _native.enable()
    yield


def cache_root() -> Path:
    """The same rule as scripts/build_models.py."""
    return Path(os.environ.get("RUNNX_CACHE") or Path.home() / ".cache" / "runnx").expanduser()


def pytest_configure(config):
    config.stash[ALLOWED_SKIPS] = read_allowed_skips()
    config.addinivalue_line("markers", "real_model: needs a real model built by `make models` (SmolLM2-135M "
                                       "and its int4, onnxruntime-genai, transformers.js, Qwen2 and Phi-3 folders, "
                                       "Whisper tiny.en); skipped when absent, a failure under CI=true")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(name in REAL_MODEL_FIXTURES for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)


def built(folder: Path, what: str, files: tuple[str, ...]) -> Path:
    """`folder` if build_models.py finished it (its stamp is written last), else skip (fail under CI)."""
    missing = [name for name in (".stamp.json", *files) if not (folder / name).is_file()]
    if missing:
        reason = f"{what} not built ({folder / missing[0]} is missing): run `make models` first"
        if under_ci():
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


DECODER_FILES = ("model.onnx", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="session")
def qwen2_dir() -> Path:
    return built(cache_root() / "models" / "qwen2-smollm2-135m", "SmolLM2-135M as Qwen2", DECODER_FILES)


@pytest.fixture(scope="session")
def phi3_dir() -> Path:
    return built(cache_root() / "models" / "phi3-smollm2-135m", "SmolLM2-135M as Phi-3", DECODER_FILES)


@pytest.fixture(scope="session")
def smollm2_int4_dir() -> Path:
    return built(cache_root() / "models" / "smollm2-135m-int4", "SmolLM2-135M int4",
                 ("model.onnx", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"))


GENAI_FILES = ("genai_config.json", "model.onnx", "model.onnx.data", "tokenizer.json", "genai_reference.json")


@pytest.fixture(scope="session")
def smollm2_genai_fp32_dir() -> Path:
    return built(cache_root() / "models" / "smollm2-135m-genai-fp32", "SmolLM2-135M by onnxruntime-genai (fp32)",
                 GENAI_FILES)


@pytest.fixture(scope="session")
def smollm2_genai_int4_dir() -> Path:
    return built(cache_root() / "models" / "smollm2-135m-genai-int4", "SmolLM2-135M by onnxruntime-genai (int4)",
                 GENAI_FILES)


@pytest.fixture(scope="session")
def qwen2_genai_fp32_dir() -> Path:
    return built(cache_root() / "models" / "qwen2-smollm2-135m-genai-fp32",
                 "SmolLM2-135M as Qwen2 by onnxruntime-genai (fp32)", GENAI_FILES)


@pytest.fixture(scope="session")
def phi3_genai_fp32_dir() -> Path:
    return built(cache_root() / "models" / "phi3-smollm2-135m-genai-fp32",
                 "SmolLM2-135M as Phi-3 by onnxruntime-genai (fp32)", GENAI_FILES)


@pytest.fixture(scope="session")
def qwen2_genai_int4_dir() -> Path:
    return built(cache_root() / "models" / "qwen2-smollm2-135m-genai-int4",
                 "SmolLM2-135M as Qwen2 by onnxruntime-genai (int4)", GENAI_FILES)


@pytest.fixture(scope="session")
def phi3_genai_int4_dir() -> Path:
    return built(cache_root() / "models" / "phi3-smollm2-135m-genai-int4",
                 "SmolLM2-135M as Phi-3 by onnxruntime-genai (int4)", GENAI_FILES)


@pytest.fixture(scope="session")
def smollm2_tjs_dir() -> Path:
    return built(cache_root() / "models" / "smollm2-135m-tjs", "SmolLM2-135M in the transformers.js layout",
                 ("onnx/model.onnx", "onnx/model_q4.onnx", "onnx/model_quantized.onnx", "config.json",
                  "generation_config.json", "tokenizer.json", "tokenizer_config.json"))


@pytest.fixture(scope="session")
def whisper_dir() -> Path:
    return built(cache_root() / "models" / "whisper-tiny.en", "Whisper tiny.en",
                 ("encoder_model.onnx", "decoder_model_merged.onnx", "config.json", "generation_config.json",
                  "tokenizer.json", "preprocessor_config.json"))


@pytest.fixture(scope="session")
def whisper_tjs_dir() -> Path:
    return built(cache_root() / "models" / "whisper-tiny.en-tjs", "Whisper tiny.en in the transformers.js layout",
                 ("onnx/encoder_model.onnx", "onnx/decoder_model_merged.onnx", "onnx/encoder_model_int8.onnx",
                  "onnx/decoder_model_merged_int8.onnx", "config.json", "generation_config.json", "tokenizer.json",
                  "preprocessor_config.json"))


@pytest.fixture(scope="session")
def whisper_genai_dir() -> Path:
    return built(cache_root() / "models" / "whisper-tiny.en-genai", "Whisper tiny.en by onnxruntime-genai",
                 ("genai_config.json", "encoder.onnx", "decoder.onnx", "tokenizer.json", "genai_reference.json"))


@pytest.fixture(scope="session")
def audio_dir() -> Path:
    return built(cache_root() / "audio", "The speech clips", ("john.wav", "long.wav", "transcripts.json"))
