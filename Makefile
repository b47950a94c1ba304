# Quick start:  make demo  (set up, build and train the demo model, run the loop on it)
#               make test  (set up, run the test suite)
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; set TORCH_SPEC= to keep a torch you already have (e.g. a CUDA build).
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test test-all bench setup clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/pip install -q -e '.[hf,test]'
	touch $@

demo: setup
	$(BIN)/ktc demo

# The tests in worker processes, a file at a time each, as many as cores (tests/conftest.py caps it):
# on two cores 6.9-7.3 min against 10.7-11.7 in one process, most of it compiling kernels.
PYTEST := $(BIN)/python -m pytest -q -n auto --dist loadfile

test: setup
	$(PYTEST)

test-all: setup
	$(PYTEST) -m "not gpu"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
