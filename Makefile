# Tandem: `make chat` runs the app, `make test` runs lint and tests. Both create .venv on first use.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: chat test lint clean

# Installs once; re-runs only when pyproject.toml or the C kernels change.
$(STAMP): pyproject.toml $(wildcard kernels/csrc/*.c)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

# For now `make chat` streams an answer from a small random-weight Mixtral-format checkpoint
# (written once to .cache/): it shows the pipeline working end to end, but its words are random.
TEST_MODEL := .cache/test-model-mixtral
PROMPT     ?= What is the capital of France?

chat: $(STAMP)
	@test -d $(TEST_MODEL) || $(BIN)/tandem make-test-model --family mixtral --out $(TEST_MODEL)
	$(BIN)/tandem generate --model $(TEST_MODEL) --chat --prompt "$(PROMPT)" --max-new-tokens 48

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .cache build *.egg-info
