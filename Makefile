# runnx developer entry points. Python 3.11+ is all a machine needs; `make models` also needs
# espeak-ng and sox for the speech clips (Debian: apt-get install -y espeak-ng sox).
#   make install   .venv with runnx (editable) and the test extra
#   make test      the whole test suite, 2 workers (extra pytest arguments: make test ARGS='-k cli')
#   make models    real models + speech clips into ${RUNNX_CACHE:-~/.cache/runnx} (idempotent)
#   make fixtures  rebuild the committed tiny models in tests/fixtures (deterministic)
#   make demo      run the tiny Llama fixture with a profile
PYTHON ?= python3
ARGS ?=
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.runnx-installed

.PHONY: install test models fixtures demo

install: $(INSTALLED)

$(INSTALLED): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -q -e '.[test]'
	touch $@

test: install
	$(BIN)/python -m pytest -q -n 2 -p no:cacheprovider $(ARGS)

models:
	$(PYTHON) scripts/build_models.py all

fixtures:
	$(PYTHON) scripts/build_models.py tiny

demo: install models
	$(BIN)/runnx run tests/fixtures/tiny-llama/model.onnx --profile
