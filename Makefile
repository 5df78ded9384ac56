# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of PyTorch; a looser request pulls a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
# The oldest transformers harts supports (pyproject.toml); `make test` runs the suite on it too.
# Families it lacks (bailing_hybrid, kimi_linear) are skipped there, saying so.
OLDEST := .venv-oldest
OLDEST_TRANSFORMERS := transformers==5.10.4

.PHONY: demo test test-newest test-oldest lint bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

$(OLDEST)/.installed: pyproject.toml
	test -x $(OLDEST)/bin/python || $(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install -q --upgrade pip
	$(OLDEST)/bin/python -m pip install -q $(TORCH_PIN) $(OLDEST_TRANSFORMERS)
	$(OLDEST)/bin/python -m pip install -q -e ".[dev]" $(OLDEST_TRANSFORMERS)
	touch $@

demo: $(VENV)/.installed
	$(PY) -m harts.demo

# the newest transformers the range allows, then the oldest
test: test-newest test-oldest

test-newest: $(VENV)/.installed
	$(PY) -m pytest -q

test-oldest: $(OLDEST)/.installed
	$(OLDEST)/bin/python -m pytest -q -p no:cacheprovider

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks

bench: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[bench]"
	$(VENV)/bin/harts bench $(ARGS)

clean:
	rm -rf $(VENV) $(OLDEST) build src/*.egg-info .pytest_cache
