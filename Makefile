# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of PyTorch; a looser request pulls a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
# The oldest transformers harts supports (pyproject.toml); `make test` runs the suite on it too.
# Families it lacks (bailing_hybrid, kimi_linear) are skipped there, saying so.
# The newest transformers harts supports, pinned so that `make test` runs on it whatever the index holds.
NEWEST_TRANSFORMERS := transformers==5.25.0
OLDEST := .venv-oldest
OLDEST_TRANSFORMERS := transformers==5.10.4
# The GPU kernels (the `gpu` extra) checked on the CPU under the triton interpreter, in their own venv:
# with triton present, transformers picks its kernels at import and `.venv`'s stock forward would fail.
KERNELS := .venv-kernels
# verl pins transformers to 5.10.x and pulls its own stack: its integration tests get a venv of their own.
VERL := .venv-verl
VERL_PIN := verl==0.9.1
# `make gpu-check` on a machine with a CUDA GPU: torch's default (CUDA) build and the `gpu` extra in their
# own venv. GPU_PYTHON=python3 runs the check with that interpreter's packages instead (no install).
GPU := .venv-gpu
GPU_TORCH_PIN := torch==2.13.0

.PHONY: demo test test-newest test-oldest test-kernels test-verl gpu-check lint bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[dev,logging]" $(NEWEST_TRANSFORMERS) $(TORCH_PIN)
	touch $@

$(OLDEST)/.installed: pyproject.toml
	test -x $(OLDEST)/bin/python || $(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install -q --upgrade pip
	$(OLDEST)/bin/python -m pip install -q $(TORCH_PIN) $(OLDEST_TRANSFORMERS)
	$(OLDEST)/bin/python -m pip install -q -e ".[dev,logging]" $(OLDEST_TRANSFORMERS) $(TORCH_PIN)
	touch $@

$(KERNELS)/.installed: pyproject.toml
	test -x $(KERNELS)/bin/python || $(PYTHON) -m venv $(KERNELS)
	echo '*' > $(KERNELS)/.gitignore  # as python 3.13's venv writes: git never sees it
	$(KERNELS)/bin/python -m pip install -q --upgrade pip
	$(KERNELS)/bin/python -m pip install -q $(TORCH_PIN)
	$(KERNELS)/bin/python -m pip install -q -e ".[dev,gpu]" $(NEWEST_TRANSFORMERS) $(TORCH_PIN)
	touch $@

$(VERL)/.installed: pyproject.toml
	test -x $(VERL)/bin/python || $(PYTHON) -m venv $(VERL)
	echo '*' > $(VERL)/.gitignore
	$(VERL)/bin/python -m pip install -q --upgrade pip
	$(VERL)/bin/python -m pip install -q $(TORCH_PIN)
	$(VERL)/bin/python -m pip install -q -e ".[dev]" $(VERL_PIN) $(TORCH_PIN)
	touch $@

$(GPU)/.installed: pyproject.toml
	test -x $(GPU)/bin/python || $(PYTHON) -m venv $(GPU)
	echo '*' > $(GPU)/.gitignore
	$(GPU)/bin/python -m pip install -q --upgrade pip
	$(GPU)/bin/python -m pip install -q $(GPU_TORCH_PIN)
	$(GPU)/bin/python -m pip install -q -e ".[dev,gpu]" $(NEWEST_TRANSFORMERS) $(GPU_TORCH_PIN)
	touch $@

demo: $(VENV)/.installed
	$(PY) -m harts.demo

# the newest transformers the range allows, then the oldest
test: test-newest test-oldest

test-newest: $(VENV)/.installed
	$(PY) -m pytest -q

# what a transformers version can change: each family's stock classes (tests/conftest.py, --version-axis).
# The multi-process and slow tests check harts' own code, the same on both ends: they run once, above.
test-oldest: $(OLDEST)/.installed
	$(OLDEST)/bin/python -m pytest -q -p no:cacheprovider -m "not multiprocess and not slow" --version-axis

# tests_kernels/ (never collected by `make test`): fla's triton kernels and FlexAttention on CPU tensors
test-kernels: $(KERNELS)/.installed
	TRITON_INTERPRET=1 $(KERNELS)/bin/python -m pytest -q -p no:cacheprovider tests_kernels

# the integrations against verl's own code (its DataProto layout, its losses, its engine registry)
test-verl: $(VERL)/.installed
	$(VERL)/bin/python -m pytest -q -p no:cacheprovider tests/test_integrations_verl.py tests/test_integrations_verl_sharded.py \
		tests/test_integrations_trl.py tests/test_integrations_batch.py

# every CUDA check (tests, kernels on the device, harts bench with fla and with plain PyTorch) in one
# command within 8 minutes; without a CUDA device it says so, runs the backend's CPU tests and exits 0
gpu-check:
	@if [ -n "$(GPU_PYTHON)" ]; then \
		PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m harts.bench.gpu_check $(ARGS); \
	elif nvidia-smi -L >/dev/null 2>&1; then \
		$(MAKE) $(GPU)/.installed && $(GPU)/bin/python -m harts.bench.gpu_check $(ARGS); \
	else \
		$(MAKE) $(VENV)/.installed && $(PY) -m harts.bench.gpu_check $(ARGS); \
	fi

# ruff format is the formatter of src/: the size rules (tests/test_architecture.py) hold on what it leaves
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests tests_kernels examples
	$(VENV)/bin/ruff format --check src

bench: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[bench]"
	$(VENV)/bin/harts bench $(ARGS)

clean:
	rm -rf $(VENV) $(OLDEST) $(KERNELS) $(VERL) $(GPU) build src/*.egg-info .pytest_cache
